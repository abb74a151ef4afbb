"""The CPU paged-attention kernel (engines/cpu/paged_kernel.py) against the per-sequence SDPA loop."""

from __future__ import annotations

import pytest
import torch
from staggered import run_staggered

import engines.cpu.paged_kernel as pk
from engines import EngineConfig, SamplingParams
from engines.core.llm_engine import LLMEngine
from engines.core.plan import SeqWork
from engines.cpu.paged_kernel import load
from engines.model import attention
from engines.model.attention import KVCache, PagedAttention

pytestmark = pytest.mark.skipif(load()[0] is None, reason="the C++ kernel cannot be built here")


def _decode_case(dtype: torch.dtype, nh: int, nkv: int, threads: int, bs: int = 4,
                 hd: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Five sequences with block tables that are out of order, split into runs and partly filled;
    (kernel output, loop output) of one layer."""
    torch.manual_seed(0)
    tables = [[7], [3, 4, 5], [20, 2, 9, 10], [11, 12, 13, 14, 15, 16], [30, 29, 28]]
    ctx = [1, 9, 16, 23, 10]  # keys each sequence sees, including this step's
    if bs > 4:  # the same tables, longer blocks: lengths that end mid-block and past a W-key tile
        ctx = [1, 2 * bs + 3, 3 * bs, 6 * bs - 5, bs + 1]
    decode = [SeqWork(seq_id=i, token_ids=[1], start_pos=c - 1, sample=True, block_ids=t)
              for i, (t, c) in enumerate(zip(tables, ctx))]
    data = torch.randn(1, 2, 32 * bs, nkv, hd).to(dtype)
    q, k, v = (torch.randn(5, h, hd).to(dtype) for h in (nh, nkv, nkv))
    outs = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for kernel in (True, False):
            cache = KVCache(1, 32, bs, nkv, hd, dtype)
            cache.data.copy_(data)
            outs.append(PagedAttention(cache, decode, [], torch.device("cpu"), decode_kernel=kernel)(0, q, k, v))
    finally:
        torch.set_num_threads(before)
    return outs[0], outs[1]


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_kernel_equals_the_loop_fp32(nh, nkv):
    got, ref = _decode_case(torch.float32, nh, nkv, threads=2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_kernel_equals_the_loop_bf16():
    got, ref = _decode_case(torch.bfloat16, 4, 2, threads=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs,hd,nh,nkv", [(16, 64, 9, 3), (32, 128, 8, 2), (16, 32, 14, 2), (8, 24, 4, 2),
                                          (16, 80, 4, 4), (16, 64, 4, 2)])
def test_kernel_equals_the_loop_at_served_head_sizes(dtype, bs, hd, nh, nkv):
    """Head sizes 16/32/64/128 run the tiled code (a block's keys W at a time), others the per-key loop;
    both against the SDPA loop, with block sizes past one W-key tile. Groups of 3, 4, 7 and 2 query heads a kv
    head: an AVX2 build's bf16 value pass takes them three or two at a time, a last one alone."""
    got, ref = _decode_case(dtype, nh, nkv, threads=2, bs=bs, hd=hd)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_the_loop_without_grouped_heads(dtype, threads):
    """GPT-2's heads (12 of 64, each its own keys and values), which an AVX2 build walks in memory order, a
    position's heads 8 at a time: one thread's tasks hold a sequence's 12 heads (8, then 4), two threads' hold 6
    each (the five sequences' heads split over two tasks)."""
    got, ref = _decode_case(dtype, 12, 12, threads=threads, bs=16, hd=64)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_uses_the_kernel_at_any_batch(rows, monkeypatch):
    """With the kernel on, every decode step goes through it, batch 1 included, on any thread count."""
    import engines.model.attention as att

    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return pk.paged_decode(*args)

    monkeypatch.setattr(att, "paged_decode", spy)
    cache = KVCache(1, 8, 4, 2, 8, torch.float32)
    work = [SeqWork(seq_id=i, token_ids=[1], start_pos=4, sample=True, block_ids=[2 * i, 2 * i + 1])
            for i in range(rows)]
    q, k, v = (torch.randn(rows, 2, 8) for _ in range(3))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            PagedAttention(cache, work, [], torch.device("cpu"), decode_kernel=True)(0, q, k, v)
    finally:
        torch.set_num_threads(before)
    assert calls == [rows, rows]


def test_kernel_does_not_depend_on_the_thread_count():
    from engines.cpu.paged_kernel import paged_decode

    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    q, table, lens = torch.randn(3, 4, 16), torch.tensor([[3, 1, 2], [0, 9, 0], [15, 14, 13]]), torch.tensor([9, 5, 12])
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(paged_decode(q, cache_k, cache_v, table, lens, 4))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_kernel_rejects_a_length_beyond_its_table():
    from engines.cpu.paged_kernel import paged_decode

    cache = torch.zeros(8, 2, 4)
    with pytest.raises(RuntimeError, match="outside its block table"):
        paged_decode(torch.zeros(1, 2, 4), cache, cache, torch.tensor([[0]]), torch.tensor([5]), 4)


GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 6, 14, 9, 17, 3)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_the_kernel_equals_the_loop_through_preemption(gpt2_dir, dtype, monkeypatch):
    # fp32: the kernel engine prefills through causal_prefill, the loop engine per sequence (torch's SDPA), and the
    # tokens agree. bf16: both prefill per sequence, so that only decode differs (causal_prefill's bf16 rounds
    # otherwise than SDPA's; tests/test_paged_cascade.py checks it against SDPA within bf16's tolerance)
    if dtype == "bfloat16":
        monkeypatch.setattr(attention, "CAUSAL_PREFILL", False)
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "cpu_linear_autotune": False,
            "dtype": dtype}
    loop = LLMEngine(gpt2_dir, EngineConfig(decode_attention="loop", **base))
    kernel = LLMEngine(gpt2_dir, EngineConfig(decode_attention="kernel", **base))
    assert kernel.executor.runner.decode_kernel and not loop.executor.runner.decode_kernel
    assert run_staggered(kernel, GREEDY) == run_staggered(loop, GREEDY)
    assert kernel.scheduler.num_preemptions > 0


def test_decode_attention_is_validated():
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="fast")


def test_kernel_asked_for_but_unavailable_fails_at_load(gpt2_dir, monkeypatch):
    import engines.cpu.paged_kernel as pk

    monkeypatch.setattr(pk, "load", lambda: (None, "no compiler"))
    with pytest.raises(RuntimeError, match="decode_attention: 'kernel' but no compiler"):
        LLMEngine(gpt2_dir, EngineConfig(decode_attention="kernel", cpu_linear_autotune=False))
    auto = LLMEngine(gpt2_dir, EngineConfig(decode_attention="auto", cpu_linear_autotune=False))
    assert auto.executor.runner.decode_kernel is False


ARGMAX_VARIANTS = {"auto": 0, "portable": 1, "avx2": 2}


@pytest.mark.parametrize("variant", ARGMAX_VARIANTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_torch_argmax(threads, variant):
    """The vectorized greedy pick, each variant forced: first index of the maximum, ties across lanes and
    the tail, -inf rows, +inf, NaN (torch counts a NaN as the maximum: its first NaN), short rows and a
    GPT-2 row."""
    from engines.core.hardware import read_cpu_flags

    if variant == "avx2" and "avx2" not in (read_cpu_flags() or ()):
        pytest.skip("this CPU has no AVX2")
    mod = load()[0]
    argmax_rows = mod.argmax_rows if variant == "auto" else lambda x: mod.argmax_rows_variant(x, ARGMAX_VARIANTS[variant])
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for V in (1, 5, 16, 31, 32, 33, 47, 100, 50257):
            x = torch.randn(9, V)
            x[1] = 0.5  # every entry tied: index 0
            x[2] = float("-inf")  # a fully banned row
            x[3, V // 2:] = x[3].max() + 1  # ties from the middle on: the first of them
            x[4, -1] = float("inf")
            x[5, V // 3] = float("nan")
            x[6, (V - 1, V // 2)] = float("nan")  # two NaNs: the earlier one
            x[7] = torch.randint(0, 3, (V,)).float()  # many ties at 2
            x[8, 0] = float("nan")
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), V
        zeros = torch.full((1, 100), -1.0)
        zeros[0, 40], zeros[0, 70] = -0.0, 0.0  # -0 and +0 tie: the first
        assert argmax_rows(zeros).tolist() == [40] == zeros.argmax(dim=-1).tolist()
        half = torch.randn(4, 2 * 50257)[:, ::2]  # not contiguous
        assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="float32"):
        argmax_rows(torch.randn(2, 8).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="variant 0 .auto., 1 .portable. or 2 .AVX2., got 3"):
        mod.argmax_rows_variant(torch.randn(2, 8), 3)
