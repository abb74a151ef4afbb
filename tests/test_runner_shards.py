"""One runner (engines/runner/model_runner.py) for one device and for every shard: TP and PP shards take the same
fast decode paths as one device (the fused CPU step, the static step), recorded in runner.paths, and
give the single-device tokens. Shards are threads of this process (tests/parallel_fixtures.py)."""

from __future__ import annotations

import pytest
import torch
from parallel_fixtures import PROMPTS, LogitsRecorder, ThreadTPExecutor, make_own_checkpoint, run_engine

from engines.core.config import EngineConfig
from engines.core.executor import InProcessExecutor
from engines.cpu.fused_decode import load

pytestmark = pytest.mark.skipif(load()[0] is None, reason="the fused decode step does not build here")

# plain nn.Linear everywhere: every Linear's kernel is one the fused step calls on any host
BASE = EngineConfig(num_kv_blocks=64, cpu_linear_autotune=False)


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    """Qwen2-shaped (qkv biases: column-parallel, sliced) and Qwen3-shaped (per-head q / k RMSNorms:
    replicated) checkpoints."""
    shape = {"vocab_size": 397, "n_layer": 2, "n_head": 4, "n_embd": 64, "n_kv_head": 2, "intermediate_size": 128,
             "tie_word_embeddings": False, "bias": False, "activation": "silu"}
    return {"qwen2": make_own_checkpoint(tmp_path_factory.mktemp("qwen2"), model_type="qwen2", qkv_bias=True, **shape),
            "qwen3": make_own_checkpoint(tmp_path_factory.mktemp("qwen3"), model_type="qwen3", qk_norm=True, **shape)}


@pytest.mark.parametrize("which, tp, pp", [("llama", 2, 1), ("llama", 1, 2), ("gpt2", 2, 1), ("gpt2", 1, 2),
                                           ("qwen2", 2, 1), ("qwen3", 2, 1)])
def test_shards_take_the_fused_step(which, tp, pp, gpt2_dir, llama_dir, qwen_dirs):
    """GPT-2 TP: the row-parallel biases are added after the all-reduce; GPT-2 PP: positions are
    learned on the first stage only."""
    d = {"gpt2": gpt2_dir, "llama": llama_dir, **qwen_dirs}[which]
    ref, eng = run_engine(d, InProcessExecutor(d, BASE), BASE)
    one = eng.executor.runner
    assert one.paths["fused"] > 0 and "fused" not in one.why_not
    ex = ThreadTPExecutor(d, BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    outs, _ = run_engine(d, ex, BASE)
    assert outs == ref
    for r in ex.runners:
        assert "fused" not in r.why_not, r.why_not
        # every decode micro-batch of every shard ran fused, as on one device
        assert r.paths["fused"] == one.paths["fused"] > 0 and r.paths["eager"] == one.paths["eager"], r.paths


def test_tp_fused_step_is_the_module_path_bitwise(gpt2_dir):
    """A TP shard's fused step split at its all-reduces computes exactly what its module path does."""
    prompts = PROMPTS[:2]
    runs = {}
    for fused in ("auto", "off"):
        cfg = BASE.replace(fused_decode=fused)
        rec = LogitsRecorder(ThreadTPExecutor(gpt2_dir, cfg.replace(tensor_parallel_size=2)))
        outs, _ = run_engine(gpt2_dir, rec, cfg, prompts=prompts)
        runs[fused] = outs, rec.logits, rec.inner.runners[0].paths
    assert runs["auto"][2]["fused"] > 0 and runs["off"][2]["fused"] == 0
    assert runs["auto"][0] == runs["off"][0]
    for seq_id, rows in runs["off"][1].items():
        assert all(torch.equal(a, b) for a, b in zip(runs["auto"][1][seq_id], rows))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_shards_take_the_static_step(tp, pp, llama_dir):
    """static_decode on: the padded-bucket step (what CUDA captures as graphs) on TP and PP shards; a
    later stage's input buffer holds the received hidden states."""
    cfg = BASE.replace(static_decode="on")
    ref, eng = run_engine(llama_dir, InProcessExecutor(llama_dir, cfg), cfg)
    assert eng.executor.runner.paths["static"] > 0
    ex = ThreadTPExecutor(llama_dir, cfg.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    outs, _ = run_engine(llama_dir, ex, cfg)
    assert outs == ref
    for r in ex.runners:
        assert r.paths["static"] == eng.executor.runner.paths["static"] and r.paths["fused"] == 0, r.paths
        assert r.why_not["fused"] == "the static decode runner takes decode steps"


def test_tp_shard_says_why_it_is_not_compiled(llama_dir, monkeypatch):
    """A TP shard's step is not compiled (its all-reduce cannot be traced into one graph; the config
    refuses compile_decode on with TP, and the runner says why should one reach it); its decode steps
    take the fused step instead."""
    import engines.runner.model_runner as runner_mod

    monkeypatch.setattr(runner_mod, "resolve_compile", lambda mode, device: (True, "compiled (test)"))
    ex = ThreadTPExecutor(llama_dir, BASE.replace(tensor_parallel_size=2))
    for r in ex.runners:
        assert r.decode_runner is None and r.why_not["compiled"] == runner_mod.TP_NOT_COMPILED
        assert r.fused is not None and "fused" not in r.why_not
