"""The fused decode step (engines/cpu/fused_decode.py): the blocks of a decode-only step in one C++ call
give bitwise the module path's tokens and logprobs (GPT-2 and Llama: GQA, tied and untied heads, fp32
and bf16), and it runs only where it applies."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from staggered import run_staggered
from torch import nn

import engines.cpu.fast_linear as fl
import engines.cpu.fp8_linear as f8
import engines.cpu.fused_decode as fd
from engines import EngineConfig, SamplingParams
from engines.core.llm_engine import LLMEngine
from engines.cpu.paged_kernel import load as load_paged
from engines.cpu.panel_kernel import load as load_panel

pytestmark = pytest.mark.skipif(load_paged()[0] is None or load_panel()[0] is None,
                                reason="the C++ kernels cannot be built here")

PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (20, 6, 14, 9, 17, 3)]


def _force(monkeypatch, kinds=("panel", "panel", "linear"), dtype="float32"):
    """Every Linear takes these kernels (one row, decode batch, prefill: short and long chunks alike) instead of the
    timed ones."""
    if "packed" in kinds and not fl.packing_available(getattr(torch, dtype)):
        pytest.skip(f"oneDNN's prepacked {dtype} linear needs CPU features this host lacks")
    monkeypatch.setattr(fl, "choose_kernels", lambda weight, bias, budget_s=0.4: (*kinds, kinds[2]))


def _tokens_and_logprobs(completion) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top) for e in completion.logprobs]


@pytest.mark.parametrize(("dtype", "kinds"), [
    ("float32", ("panel", "panel", "linear")), ("bfloat16", ("panel", "panel", "linear")),
    ("float32", ("panel", "packed", "linear")), ("bfloat16", ("packed", "linear", "linear")),
    ("float32", ("pretransposed", "pretransposed", "linear")), ("bfloat16", ("gemv", "pretransposed", "linear"))])
def test_fused_step_equals_the_module_path_through_chunks_and_preemption(gpt2_dir, monkeypatch, dtype, kinds):
    """Every kernel the C++ loop calls (one row / a decode batch), against the module path."""
    _force(monkeypatch, kinds, dtype)
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16, "adaptive_threads": False}  # prompts of 17-37 tokens: chunked prefill
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
    ("float32", True, ("packed", "pretransposed", "linear")), ("bfloat16", False, ("linear", "pretransposed", "linear")),
    ("bfloat16", True, None)])  # None: autotuning off, every block Linear a plain nn.Linear
def test_llama_fused_step_equals_the_module_path(llama_dir, tied_llama_dir, monkeypatch, dtype, tied, kinds):
    """Llama (RMSNorm, rotary, GQA 4 q / 2 kv heads, SwiGLU, tied or untied head): bit for bit in fp32 and
    in bf16 too (the same ops in the same order; the rotation rounds each product as torch does)."""
    if kinds is not None:
        _force(monkeypatch, kinds, dtype)
    model_dir = tied_llama_dir if tied else llama_dir
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16, "adaptive_threads": False, "cpu_linear_autotune": kinds is not None}
    off = LLMEngine(model_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(model_dir, EngineConfig(fused_decode="auto", **base))
    runner = fused.executor.runner
    assert runner.fused is not None and runner.fused.family.rope and runner.fused.family.rms
    assert runner.cfg.kv_heads < runner.cfg.n_head
    assert (runner.model.lm_head.weight is runner.model.wte.weight) == tied
    _assert_fused_equals_module_path(off, fused, monkeypatch)


def test_not_used_where_it_does_not_apply(gpt2_dir, llama_dir, monkeypatch):
    _force(monkeypatch)
    llama = LLMEngine(llama_dir, EngineConfig()).executor.runner
    assert llama.fused is not None and fd.why_not(llama.model, llama.device) is None
    llama.model.blocks[1].attn.extra = nn.Identity()  # a part the loop does not know: refused by name
    assert "['extra']" in fd.why_not(llama.model, llama.device)
    del llama.model.blocks[1].attn.extra
    llama.model.blocks[0].attn.kv_hook = lambda layer, k, v: (k, v)
    assert "kv_hook" in fd.why_not(llama.model, llama.device)
    plain = LLMEngine(gpt2_dir, EngineConfig(cpu_linear_autotune=False)).executor.runner  # nn.Linear: F.linear
    assert plain.fused is not None and plain.fused.kinds(3) == [fd.KERNELS["linear"]] * len(plain.fused.linears)
    plain.model.blocks[0].mlp.down = torch.nn.Bilinear(2, 2, 2)  # not a Linear it can call
    assert "Bilinear" in fd.why_not(plain.model, plain.device)
    loop = LLMEngine(gpt2_dir, EngineConfig(decode_attention="loop")).executor.runner  # no paged kernel
    assert loop.fused is None


def test_fused_decode_is_validated():
    with pytest.raises(ValueError, match="fused_decode"):
        EngineConfig(fused_decode="on")


def _qwen3_as_ours(hf, cfg):
    """Our GPT with HF Qwen3's weights, plus per-head q / k RMSNorms on each block's attention (the parts
    a Qwen3 adds; the fused step takes their weights)."""
    from engines.model.transformer import GPT, RMSNorm

    model = GPT(cfg).eval()
    sd = hf.state_dict()
    with torch.no_grad():
        model.wte.weight.copy_(sd["model.embed_tokens.weight"])
        model.norm_f.weight.copy_(sd["model.norm.weight"])
        model.lm_head.weight.copy_(sd["lm_head.weight"])
        for i, b in enumerate(model.blocks):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            b.attn.qkv.weight.copy_(torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]))
            b.attn.qkv.bias.copy_(torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]))
            b.attn.proj.weight.copy_(sd[a + "o_proj.weight"])
            b.attn.proj.bias.copy_(sd[a + "o_proj.bias"])
            b.mlp.up.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            b.mlp.down.weight.copy_(sd[p + "mlp.down_proj.weight"])
            b.norm1.weight.copy_(sd[p + "input_layernorm.weight"])
            b.norm2.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            for n in ("q_norm", "k_norm"):
                norm = RMSNorm(cfg.hd, cfg.norm_eps)
                norm.weight.copy_(sd[a + f"{n}.weight"])
                setattr(b.attn, n, norm)
    return model


@pytest.mark.parametrize("seqs", [1, 2])
def test_qk_norm_and_qkv_bias_match_transformers_qwen3(monkeypatch, seqs):
    """The optional inputs (Linear biases, per-head q / k RMSNorm before the rotation) against HF Qwen3 on a
    tiny random config: one or two sequences decoded a token a step through the fused loop on a team of 2 threads
    (one sequence: each thread norms, rotates, caches and attends its own kv heads; two: each its sequence), every
    hidden state equal to transformers' (fp32, 1e-5)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engines.core.config import ModelConfig
    from engines.model.attention import KVCache

    _force(monkeypatch)
    torch.manual_seed(0)
    hf_cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64)
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    theta = getattr(hf_cfg, "rope_theta", None) or hf_cfg.rope_parameters["rope_theta"]
    cfg = ModelConfig(model_type="llama", vocab_size=96, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, head_dim=16,
                      intermediate_size=128, norm_eps=1e-6, rope_theta=theta, bias=True, activation="silu",
                      tie_word_embeddings=False, max_position_embeddings=64)
    model = _qwen3_as_ours(hf, cfg)
    fl.apply_fast_linear(model)
    assert fd.why_not(model, torch.device("cpu")) is None and fd.family(model).qk_norm
    cache = KVCache(cfg.n_layer, 8, 4, cfg.kv_heads, cfg.hd, torch.float32)
    fused = fd.FusedDecode(model, [cache.data[i, 0] for i in range(2)], [cache.data[i, 1] for i in range(2)])
    ids = torch.randint(0, 96, (2, 11))[:seqs]
    table = torch.tensor([[0, 1, 2], [5, 3, 4]])[:seqs]  # sequence 1's blocks out of order
    got = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                slots = table[:, t // 4] * 4 + t % 4
                got.append(fused.run(ids[:, t][None], torch.tensor([[t] * seqs]), slots, table,
                                     torch.tensor([t + 1] * seqs), 4))
            expect = hf(ids, output_hidden_states=True).hidden_states[-1]  # (seqs, T, C) after the final norm
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(torch.cat(got)[:, :, :].transpose(0, 1), expect, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama_odd_dir(tmp_path_factory):
    """A Llama whose MLP width (520) makes its gate / up Linear 65 panels of 16 outputs: a team's claims end in a
    single panel past the last whole pass of 4, which a thread claiming from the back runs first (fused_team.cpp),
    and on AVX2 its one-row claims run blocks of passes (csrc/fp8_range.cpp), the back thread's from the last."""
    return make_checkpoint(tmp_path_factory.mktemp("llama_odd"), "llama", intermediate_size=520)


@pytest.mark.parametrize(("dtype", "variant"), [("float32", "portable"), ("bfloat16", "auto"), ("bfloat16", "avx2"),
                                              ("bfloat16", "avx512_on_avx2")])
def test_fp8_fused_step_equals_the_module_path(llama_odd_dir, monkeypatch, dtype, variant):
    """FP8 weight-only blocks (quantized at load, kept one byte a weight in Fp8PanelLinear panels): the fused
    step runs them through the same FP8 kernel variant as the module path, bit for bit (tokens and logprobs),
    on a team of the host's cores (the threads claiming panels from the back run their passes backwards)."""
    llama_dir = llama_odd_dir
    from engines.cpu.panel_kernel import FP8_VARIANTS

    _force(monkeypatch, dtype=dtype)
    make = f8.Fp8PanelLinear.from_fp8.__func__
    monkeypatch.setattr(f8.Fp8PanelLinear, "from_fp8",
                        classmethod(lambda cls, mod, dt, variant_=variant: make(cls, mod, dt, variant_)))
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16, "adaptive_threads": False, "weight_dtype": "fp8"}
    off = LLMEngine(llama_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(llama_dir, EngineConfig(fused_decode="auto", **base))
    runner = fused.executor.runner
    assert runner.fused is not None, runner.why_not
    assert all(isinstance(lin, f8.Fp8PanelLinear) and lin.variant == variant for lin in runner.fused.linears)
    assert runner.fused.kinds(1) == [fd.FP8_KERNEL + FP8_VARIANTS[variant]] * len(runner.fused.linears)
    _assert_fused_equals_module_path(off, fused, monkeypatch)


def _assert_fused_equals_module_path(off, fused, monkeypatch) -> None:
    """The fused engine's tokens and logprobs equal the module path's, and its fused step ran many
    decode steps, some of them batched."""
    runner = fused.executor.runner
    calls = []
    run = runner.fused.run
    monkeypatch.setattr(runner.fused, "run", lambda *a: calls.append(a[0].shape[1]) or run(*a))
    expect, got = (run_staggered(e, PARAMS, _tokens_and_logprobs) for e in (off, fused))
    assert got == expect
    assert len(calls) > 20 and max(calls) > 1


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_step_team_at_any_thread_count(llama_dir, monkeypatch, threads):
    """The step as one parallel region (csrc/fused_team.cpp) on one thread, and on more threads than a step has
    sequences or some Linears have panels (a thread with no share still meets every barrier): FP8 blocks in
    bf16, bit for bit the module path's tokens and logprobs."""
    _force(monkeypatch, dtype="bfloat16")
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": "bfloat16",
            "max_num_batched_tokens": 16, "weight_dtype": "fp8", "worker_threads": threads}
    off = LLMEngine(llama_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(llama_dir, EngineConfig(fused_decode="auto", **base))
    assert fused.executor.runner.fused is not None, fused.executor.runner.why_not
    _assert_fused_equals_module_path(off, fused, monkeypatch)


def _off_and_fused(llama_dir, monkeypatch, base: dict) -> tuple[LLMEngine, LLMEngine, list[int]]:
    """The module path's engine and the fused step's on `base`, and the rows of each fused step as it runs."""
    off = LLMEngine(llama_dir, EngineConfig(fused_decode="off", **base))
    fused = LLMEngine(llama_dir, EngineConfig(fused_decode="auto", **base))
    runner = fused.executor.runner
    assert runner.fused is not None, runner.why_not
    rows = []
    run = runner.fused.run
    monkeypatch.setattr(runner.fused, "run", lambda *a: rows.append(a[0].shape[1]) or run(*a))
    return off, fused, rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("threads", "seqs"), [(2, 20), (3, 20), (2, 50)])
def test_fused_step_team_splits_the_small_ops_over_rows(llama_dir, monkeypatch, dtype, threads, seqs):
    """With SPLIT_ROWS (16) rows or more, each thread of the team runs the norms, the activation and the next
    Linear's layout of its own rows, and lays out the attention rows it computed (csrc/fused_team.cpp): 20 sequences
    decoding at once (and fewer as they finish, across the threshold), bit for bit the module path's tokens and
    logprobs, on a team of 2 and of 3; and 50 (several of the blocked rows' chunks: on AVX2, fp32 Linears of 2 rows
    or more and bf16 ones of 16 take the module path's blocked rows, bf16 widened by each thread, csrc/team_linear.cpp)."""
    _force(monkeypatch, ("panel", "panel", "linear"), dtype)
    base = {"num_kv_blocks": 800, "block_size": 4, "dtype": dtype, "max_num_batched_tokens": 2048,
            "worker_threads": threads, "adaptive_threads": False}
    off, fused, rows = _off_and_fused(llama_dir, monkeypatch, base)
    results = [_many_sequences(engine, seqs) for engine in (off, fused)]
    assert results[1] == results[0] and len(results[0]) == seqs
    assert max(rows) == seqs and min(rows) < 16  # split steps, and steps below the threshold


def _many_sequences(engine, seqs: int) -> dict:
    """Each sequence's tokens and logprobs, `seqs` sequences added at once (prompts of 7 tokens and more, 6-12 new
    tokens each: steps of `seqs` rows, then fewer as they finish)."""
    for i in range(seqs):
        engine.add_request(f"r{i}", list(range(5 + i, 12 + 2 * i)),
                           SamplingParams(temperature=0, max_tokens=6 + i % 7, ignore_eos=True, logprobs=2))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = _tokens_and_logprobs(out.outputs[0])
    return final


def _avx2_runs() -> bool:
    from engines.cpu import panel_kernel

    try:
        return panel_kernel.panel_variant("avx2") == "avx2"
    except ValueError:
        return False


@pytest.mark.skipif(not _avx2_runs(), reason="the panel kernel's avx2 variant does not run here")
@pytest.mark.parametrize(("dtype", "threads", "seqs", "others"), [
    ("float32", 2, 50, "panel"), ("bfloat16", 2, 50, "panel"), ("bfloat16", 1, 20, "panel"),
    ("float32", 2, 20, "pretransposed")])
def test_fused_step_runs_both_panel_kinds_side_by_side(llama_dir, monkeypatch, dtype, threads, seqs, others):
    """The panel kernel's auto pinned to the portable code (an AVX-512 host's case, here on any AVX2 host): the closing
    Linears (the attention's output and the MLP's down projection) on the avx2 kind (fast_linear.PANEL_KINDS: its
    row-major blocks; block_linear's PANEL_AVX2), the others on `others` (panel: the portable decode layout, so the
    team lays out each Linear's rows for its own code; pretransposed: the per-op loop). Bit for bit the module path's
    tokens and logprobs (which runs the same kinds, prefill chunks' linear_add included)."""
    import json

    from engines.cpu import panel_kernel

    width = json.loads((llama_dir / "config.json").read_text())["hidden_size"]
    monkeypatch.setattr(fl, "choose_kernels", lambda weight, bias, budget_s=0.4: (
        ("panel_avx2",) * 4 if weight.shape[0] == width else (others, others, "linear", "linear")))
    base = {"num_kv_blocks": 800, "block_size": 4, "dtype": dtype, "max_num_batched_tokens": 2048,
            "worker_threads": threads, "adaptive_threads": False}
    with panel_kernel.auto_pinned("portable"):
        off = LLMEngine(llama_dir, EngineConfig(fused_decode="off", **base))
        fused = LLMEngine(llama_dir, EngineConfig(fused_decode="auto", **base))
        runner = fused.executor.runner
        assert runner.fused is not None, runner.why_not
        kinds = runner.fused.kinds(seqs)
        assert kinds.count(fd.KERNELS["panel_avx2"]) == len(kinds) // 2 and fd.KERNELS[others] in kinds
        rows = []
        run = runner.fused.run
        monkeypatch.setattr(runner.fused, "run", lambda *a: rows.append(a[0].shape[1]) or run(*a))
        results = [_many_sequences(engine, seqs) for engine in (off, fused)]
    assert results[1] == results[0] and len(results[0]) == seqs
    assert max(rows) == seqs and min(rows) < 16


@pytest.mark.parametrize(("dtype", "threads"), [("bfloat16", 2), ("bfloat16", 3), ("float32", 2)])
def test_fp8_one_sequence_threads_lay_out_their_heads(llama_dir, monkeypatch, dtype, threads):
    """One sequence on a team: each thread attends its kv heads and lays out those heads' columns of the FP8
    projection's input itself (fused_team.cpp lay_heads; 3 threads over 2 kv heads leave one with none): tokens
    and logprobs bit for bit the module path's, over steps of one row."""
    _force(monkeypatch, dtype=dtype)
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "dtype": dtype,
            "max_num_batched_tokens": 16, "adaptive_threads": False, "weight_dtype": "fp8", "worker_threads": threads}
    off, fused, rows = _off_and_fused(llama_dir, monkeypatch, base)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def one(engine):
        engine.add_request("r", list(range(5, 30)), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return _tokens_and_logprobs(out.outputs[0])

    assert one(fused) == one(off)
    assert len(rows) >= 20 and set(rows) == {1}
