"""The tuner's boundaries: what `shardserve tune` refuses (flag named, exit 2, no traceback), what
it accepts as --model, and the deployment it emits for a device profile."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engines.core.config import ModelConfig
from shardserve.cli import app
from tuner.profiles import load_profile
from tuner.search import Candidate

TINY = ModelConfig(model_type="gpt2", vocab_size=100, n_layer=2, n_head=4, n_embd=32, max_position_embeddings=64)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_a_gpu_profile_emits_a_cuda_engine_with_one_gpu_per_shard(tmp_path, tp, pp):
    """An H100-tuned layout is served on GPUs: engine.device cuda, and one GPU reserved per shard,
    by the replica when it runs the one shard itself, by each shard worker when the model is split."""
    from deploy.schema import load_config
    from tuner.emit import deployment, write_yaml

    dep = deployment(Candidate(tp, pp, 2, 8, 512, "bfloat16"), "models/default", load_profile("h100-sxm"))
    spec = load_config(write_yaml(dep, tmp_path / "tuned.yaml", "test")).models[0]
    assert spec.engine.device == "cuda"
    assert (spec.engine.tensor_parallel_size, spec.engine.pipeline_parallel_size, spec.replicas) == (tp, pp, 2)
    if tp * pp == 1:
        assert (spec.num_gpus, spec.shard_num_gpus) == (1, 0)
    else:
        assert (spec.num_gpus, spec.shard_num_gpus) == (0, 1)


def test_a_cpu_profile_emits_a_cpu_engine_without_gpus():
    from deploy.schema import validate_config
    from tuner.emit import deployment

    cpu = load_profile("a100-80gb").replace(name="host", cores=2)
    for tp in (1, 2):
        spec = validate_config(deployment(Candidate(tp, 1, 1, 8, 512, "bfloat16"), "m", cpu)).models[0]
        assert spec.engine.device in (None, "cpu") and spec.num_gpus == spec.shard_num_gpus == 0

