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


def _tune(*args: str):
    return CliRunner().invoke(app, ["tune", *args])


@pytest.fixture
def tiny_json(tmp_path):
    path = tmp_path / "ckpt" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY.to_hf()))
    return path


SIM = ("--hardware", "a100-80gb", "--num-prompts", "5", "--input-len", "16", "--output-len", "8")

BAD_SIMULATE = [
    (["--block-size", "0"], "--block-size: must be an integer >= 1, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs: must be an integer >= 1, got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be an integer >= 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts: must be an integer >= 1, got 0"),
    (["--arrival", "gamma", "--burstiness", "0"], "--burstiness: must be a finite number > 0"),
    (["--arrival", "gamma", "--burstiness", "nan"], "--burstiness: must be a finite number > 0"),
    (["--arrival", "gamma", "--burstiness", "inf"], "--burstiness: must be a finite number > 0"),
    (["--arrival", "poisson", "--burstiness", "0.1"], "--burstiness: applies to --arrival gamma only; got --arrival poisson"),
    (["--arrival", "constant", "--burstiness", "2"], "--burstiness: applies to --arrival gamma only"),
    (["--request-rate", "nan"], "--request-rate: must be a number of requests/s > 0"),
    # the tiny model's context is 64 tokens
    (["--input-len", "60"], "--input-len: 60 prompt tokens + --output-len 8 exceed the model's context of 64"),
]


@pytest.mark.parametrize("args, message", BAD_SIMULATE, ids=[m for _, m in BAD_SIMULATE])
def test_simulate_refuses_bad_numbers_naming_the_flag(tiny_json, args, message):
    run = _tune("simulate", "--model", str(tiny_json), *SIM, *args)
    assert run.exit_code == 2 and message in run.output, run.output
    assert run.exception is None or isinstance(run.exception, SystemExit), run.exception


def test_simulate_runs_gamma_arrivals_and_a_full_context(tiny_json):
    """What the checks let through runs: burstiness with gamma, a request that fills the context."""
    run = _tune("simulate", "--model", str(tiny_json), *SIM, "--arrival", "gamma", "--burstiness", "0.5",
                "--block-size", "8", "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["kv_blocks"] >= 1
    run = _tune("simulate", "--model", str(tiny_json), *SIM[:4], "--input-len", "56", "--output-len", "8")
    assert run.exit_code == 0, run.output


def test_predict_refuses_a_request_longer_than_the_context(tiny_json):
    run = _tune("predict", "--model", str(tiny_json), "--hardware", "a100-80gb", "--input-len", "60",
                "--output-len", "8")
    assert run.exit_code == 2 and "--input-len: 60 prompt tokens + --output-len 8 exceed" in run.output, run.output
    assert '"fits"' not in run.output
    run = _tune("predict", "--model", str(tiny_json), "--hardware", "a100-80gb", "--input-len", "56",
                "--output-len", "8")
    assert run.exit_code == 0 and json.loads(run.output)["fits"] is True, run.output


def test_search_refuses_a_request_longer_than_the_context(tiny_json, tmp_path):
    run = _tune("search", "--model", str(tiny_json), "--hardware", "a100-80gb", "--input-len", "64",
                "--output-len", "8", "--out", str(tmp_path / "out"))
    assert run.exit_code == 2 and "--input-len: 64 prompt tokens" in run.output, run.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["predict", "simulate", "search"])
def test_model_takes_a_checkpoint_folder(tiny_json, tmp_path, command):
    """--model takes a checkpoint folder as every other command's --model does (its config.json)."""
    extra = {"predict": ["--input-len", "16", "--output-len", "8"], "simulate": list(SIM[2:]),
             "search": ["--devices", "1", "--input-len", "16", "--output-len", "8", "--num-prompts", "10",
                        "--tp", "1", "--pp", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                        "--weight-dtype", "bfloat16", "--out", str(tmp_path / "out")]}[command]
    run = _tune(command, "--model", str(tiny_json.parent), "--hardware", "a100-80gb", *extra)
    assert run.exit_code == 0, run.output
    if command == "search":
        assert (tmp_path / "out" / "tuned.yaml").is_file()


def test_model_refuses_what_is_not_a_model_config(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "bad.json"
    binary.write_bytes(b"\xff\xfe")
    listing = tmp_path / "list.json"
    listing.write_text("[1]")
    for path, message in ((empty, f"--model: the folder {str(empty)!r} has no config.json"),
                          (tmp_path / "nope", "--model: no such file or folder"),
                          (binary, f"--model: {binary}: not UTF-8 text"),
                          (listing, "must hold a JSON object")):
        run = _tune("predict", "--model", str(path), "--hardware", "a100-80gb")
        assert run.exit_code == 2 and message in run.output, run.output
