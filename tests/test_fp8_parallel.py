"""FP8 checkpoints under tensor and pipeline parallelism (real processes, gloo): TP=2 and PP=2 give
the TP=PP=1 tokens, the shards hold exactly their slices of the FP8 weights and scales, and
weight_dtype="fp8" quantizes a float checkpoint to the same values in every layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_fixtures import PROMPTS, LogitsRecorder, run_engine
from typer.testing import CliRunner

from engines.core.config import EngineConfig
from engines.core.executor import InProcessExecutor
from engines.loading.checkpoint import load_model
from engines.parallel.comm import LocalComm
from engines.parallel.mp_executor import MultiprocExecutor
from engines.parallel.sharded_loading import load_shard
from engines.parallel.tp import shard_spec
from engines.transforms.fp8 import Fp8Linear
from engines.transforms.fp8_format import FP8_DTYPE
from shardserve.cli import app

BASE = EngineConfig(dtype="float32", num_kv_blocks=64, worker_threads=1, dist_timeout_s=60, cpu_linear_autotune=False)
"""fp32 set explicitly: the module-scoped reference is built before the per-test CPU-flags fixture runs."""


@pytest.fixture(scope="module")
def fp8_dirs(gpt2_dir, llama_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    out = {}
    for family, src in (("gpt2", gpt2_dir), ("llama", llama_dir)):
        q = tmp_path_factory.mktemp("fp8") / family
        r = CliRunner().invoke(app, ["quantize", "--model", str(src), "--out", str(q)])
        assert r.exit_code == 0, r.output
        out[family] = (src, q)
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shards_hold_their_slices_of_weights_and_scales(fp8_dirs, family):
    """Column-parallel shards keep their rows' scales, row-parallel shards all of them, and both
    read their e4m3 slice unchanged (GPT-2's transposed Conv1D tensors included)."""
    _, q = fp8_dirs[family]
    full, cfg = load_model(q)
    for rank in range(2):
        comm = LocalComm()
        comm.tp_size, comm.tp_rank = 2, rank
        stage = load_shard(q, cfg, 0, cfg.n_layer, comm)
        for path in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down"):
            name = f"blocks.1.{path}"
            mine, whole = stage.get_submodule(name), full.get_submodule(name)
            assert isinstance(mine, Fp8Linear) and mine.weight.dtype == FP8_DTYPE
            spec = shard_spec(f"{name}.weight", cfg, 2, rank)
            assert torch.equal(mine.weight.view(torch.uint8), spec.take(whole.weight.view(torch.uint8)))
            want = spec.take(whole.weight_scale) if spec.dim == 0 else whole.weight_scale
            assert torch.equal(mine.weight_scale, want)
            assert (mine.comm is not None) == (spec.dim == 1)


@pytest.fixture(scope="module")
def reference(fp8_dirs):
    return {f: run_engine(q, InProcessExecutor(q, BASE), BASE)[0] for f, (_, q) in fp8_dirs.items()}


@pytest.mark.parametrize("family, tp, pp", [("gpt2", 2, 1), ("gpt2", 1, 2), ("llama", 2, 1), ("llama", 1, 2)],
                         ids=["gpt2-tp2", "gpt2-pp2", "llama-tp2", "llama-pp2"])
def test_fp8_tp_and_pp_give_the_single_device_tokens(fp8_dirs, reference, family, tp, pp):
    _, q = fp8_dirs[family]
    cfg = BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    ex = MultiprocExecutor(q, cfg)
    try:
        rec = LogitsRecorder(ex)
        outs, _ = run_engine(q, rec, cfg)
    finally:
        ex.shutdown()
    assert outs == reference[family]
    assert rec.logits  # the sampling rank returned the logits it sampled from
    assert len(outs) == len(PROMPTS)


def test_online_fp8_tp2_matches_the_quantized_file(fp8_dirs, reference):
    """weight_dtype="fp8" on the float llama, TP=2: a row-parallel shard quantizes with its full
    rows' absmax, so the tokens are the quantized checkpoint's at TP=1."""
    src, _ = fp8_dirs["llama"]
    cfg = BASE.replace(tensor_parallel_size=2, weight_dtype="fp8")
    ex = MultiprocExecutor(src, cfg)
    try:
        outs, _ = run_engine(src, ex, cfg)
    finally:
        ex.shutdown()
    assert outs == reference["llama"]


def test_tp_shards_fp8_layers_through_the_layer_protocol():
    """apply_tp names no FP8 class: an FP8 layer shards itself (engines.parallel.tp.ShardableLinear),
    keeping the scales of its rows (column-parallel) or all of them (row-parallel)."""
    from engines.parallel.tp import ShardableLinear, ShardSpec, _column, _row

    lin = torch.nn.Linear(32, 48, bias=True)
    fp8 = Fp8Linear.quantize(lin)
    assert isinstance(fp8, ShardableLinear) and not isinstance(lin, ShardableLinear)
    col = _column(fp8, ShardSpec(0, ((16, 40),)))
    assert isinstance(col, Fp8Linear) and col.comm is None and (col.in_features, col.out_features) == (32, 24)
    assert torch.equal(col.weight.view(torch.uint8), fp8.weight[16:40].view(torch.uint8))
    assert torch.equal(col.weight_scale, fp8.weight_scale[16:40]) and torch.equal(col.bias, fp8.bias[16:40])
    comm = LocalComm()
    row = _row(fp8, ShardSpec(1, ((8, 24),)), comm)
    assert isinstance(row, Fp8Linear) and row.comm is comm and (row.in_features, row.out_features) == (16, 48)
    assert torch.equal(row.weight.view(torch.uint8), fp8.weight[:, 8:24].view(torch.uint8))
    assert torch.equal(row.weight_scale, fp8.weight_scale) and torch.equal(row.bias, fp8.bias)
