"""The fused decode step (engines/fused_decode.py): the blocks of a decode-only step in one C++ call
give bitwise the module path's tokens and logprobs (GPT-2 and Llama: GQA, tied and untied heads, fp32
and bf16), and it runs only where it applies."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from staggered import run_staggered
from torch import nn

import engines.fast_linear as fl
import engines.fused_decode as fd
from engines import EngineConfig, SamplingParams
from engines.llm_engine import LLMEngine
from engines.paged_kernel import load as load_paged
from engines.panel_kernel import load as load_panel

pytestmark = pytest.mark.skipif(load_paged()[0] is None or load_panel()[0] is None,
                                reason="the C++ kernels cannot be built here")

PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (20, 6, 14, 9, 17, 3)]


def _force(monkeypatch, kinds=("panel", "panel", "linear")):
    """Every Linear takes these kernels (one row, decode batch, prefill) instead of the timed ones."""
    monkeypatch.setattr(fl, "choose_kernels", lambda weight, bias, budget_s=0.4: kinds)


def _tokens_and_logprobs(completion) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top) for e in completion.logprobs]


@pytest.mark.parametrize(("dtype", "kinds"), [
    ("float32", ("panel", "panel", "linear")), ("bfloat16", ("panel", "panel", "linear")),
    ("float32", ("panel", "packed", "linear")), ("bfloat16", ("packed", "linear", "linear")),
    ("float32", ("pretransposed", "pretransposed", "linear"))])
def test_fused_step_equals_the_module_path_through_chunks_and_preemption(gpt2_dir, monkeypatch, dtype, kinds):
    """Every kernel the C++ loop calls (one row / a decode batch), against the module path."""
    _force(monkeypatch, kinds)
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16}  # prompts of 17-37 tokens: chunked prefill
    off = LLMEngine(gpt2_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(gpt2_dir, EngineConfig(fused_decode="auto", **base))
    assert off.executor.runner.fused is None and fused.executor.runner.fused is not None
    calls = []
    run = fused.executor.runner.fused.run
    monkeypatch.setattr(fused.executor.runner.fused, "run", lambda *a: calls.append(a[0].shape[1]) or run(*a))
    expect, got = (run_staggered(e, PARAMS, _tokens_and_logprobs) for e in (off, fused))
    assert got == expect  # tokens and logprobs, bit for bit
    assert fused.scheduler.num_preemptions > 0
    assert len(calls) > 20 and max(calls) > 1  # decode steps of one and of several sequences ran fused


def test_usable_only_where_every_block_linear_runs_a_kernel_it_calls(gpt2_dir, monkeypatch):
    _force(monkeypatch, ("panel", "sliced", "linear"))  # one row: panel; a decode batch: sliced (not called)
    runner = LLMEngine(gpt2_dir, EngineConfig(fused_decode="auto")).executor.runner
    assert runner.fused.usable(1) and not runner.fused.usable(2)
    assert not runner.fused.usable(fl.BULK_FROM)
    assert runner.fused.kinds(1) == [fd.KERNELS["panel"]] * len(runner.fused.linears)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama_tied"), "llama", seed=1, tie_word_embeddings=True)


@pytest.mark.parametrize(("dtype", "tied", "kinds"), [
    ("float32", False, ("panel", "panel", "linear")), ("bfloat16", True, ("panel", "panel", "linear")),
    ("float32", True, ("packed", "pretransposed", "linear")), ("bfloat16", False, ("linear", "packed", "linear"))])
def test_llama_fused_step_equals_the_module_path(llama_dir, tied_llama_dir, monkeypatch, dtype, tied, kinds):
    """Llama (RMSNorm, rotary, GQA 4 q / 2 kv heads, SwiGLU, tied or untied head): bit for bit in fp32 and
    in bf16 too (the same ops in the same order; the rotation rounds each product as torch does)."""
    _force(monkeypatch, kinds)
    model_dir = tied_llama_dir if tied else llama_dir
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16}
    off = LLMEngine(model_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(model_dir, EngineConfig(fused_decode="auto", **base))
    runner = fused.executor.runner
    assert runner.fused is not None and runner.fused.family.rope and runner.fused.family.rms
    assert runner.cfg.kv_heads < runner.cfg.n_head
    assert (runner.model.lm_head.weight is runner.model.wte.weight) == tied
    calls = []
    run = runner.fused.run
    monkeypatch.setattr(runner.fused, "run", lambda *a: calls.append(a[0].shape[1]) or run(*a))
    expect, got = (run_staggered(e, PARAMS, _tokens_and_logprobs) for e in (off, fused))
    assert got == expect
    assert len(calls) > 20 and max(calls) > 1


def test_not_used_where_it_does_not_apply(gpt2_dir, llama_dir, monkeypatch):
    _force(monkeypatch)
    llama = LLMEngine(llama_dir, EngineConfig()).executor.runner
    assert llama.fused is not None and fd.why_not(llama.model, llama.device) is None
    llama.model.blocks[1].attn.extra = nn.Identity()  # a part the loop does not know: refused by name
    assert "['extra']" in fd.why_not(llama.model, llama.device)
    del llama.model.blocks[1].attn.extra
    llama.model.blocks[0].attn.kv_hook = lambda layer, k, v: (k, v)
    assert "kv_hook" in fd.why_not(llama.model, llama.device)
    plain = LLMEngine(gpt2_dir, EngineConfig(cpu_linear_autotune=False)).executor.runner  # nn.Linear, no panels
    assert plain.fused is None and "panel" in fd.why_not(plain.model, plain.device)
    loop = LLMEngine(gpt2_dir, EngineConfig(decode_attention="loop")).executor.runner  # no paged kernel
    assert loop.fused is None


def test_fused_decode_is_validated():
    with pytest.raises(ValueError, match="fused_decode"):
        EngineConfig(fused_decode="on")
