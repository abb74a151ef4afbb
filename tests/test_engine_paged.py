"""Block placement (contiguous runs when the pool allows), the two decode strategies of the
paged attention backend: in place per sequence (CPU) and one padded gather (CUDA's), and the idle
engine mapping the cache's pages ahead of their first writes (KVCache.prefault), or all of a cache the user sized
before it serves."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from engines import EngineConfig, SamplingParams
from engines.core.block_manager import BlockManager
from engines.core.llm_engine import LLMEngine
from engines.core.plan import SeqWork
from engines.core.sequence import Sequence
from engines.model.attention import KVCache, PagedAttention, block_runs


def seq(seq_id: int, prompt_len: int, max_tokens: int | None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=[1] * prompt_len,
                    prompt_len=prompt_len, params=SamplingParams(max_tokens=max_tokens))


def test_block_runs():
    assert block_runs([4, 5, 6], 8, 20) == [(32, 20)]
    assert block_runs([4, 5, 9, 2], 8, 30) == [(32, 16), (72, 8), (16, 6)]
    assert block_runs([3], 16, 1) == [(48, 1)]


def test_sequences_growing_together_stay_contiguous():
    """Decode-time growth of 8 interleaved sequences: each one's table stays one run."""
    bm = BlockManager(num_blocks=200, block_size=4, max_model_len=256)
    seqs = [seq(i, 5 + 3 * i, 40) for i in range(8)]
    for s in seqs:
        bm.allocate(s, s.prompt_len)
    for t in range(40):
        for s in seqs:
            bm.allocate(s, s.prompt_len + t + 1)
    for s in seqs:
        assert len(block_runs(s.block_ids, 4, s.prompt_len + 40)) == 1, s.block_ids
    owned = [b for s in seqs for b in s.block_ids]
    assert len(owned) == len(set(owned)) == 200 - bm.num_free
    for s in seqs:
        bm.free(s)
    assert bm.num_free == 200 and not bm._owner and not bm._reservations


def test_random_allocation_never_double_books():
    """Under pressure reservations are stolen and tables split, but a block has one owner."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4, max_model_len=512)
    live: list[Sequence] = []
    split = 0
    for i in range(3000):
        if live and (rng.random() < 0.3 or bm.num_free < 4):
            s = live.pop(rng.randrange(len(live)))
            split += len(block_runs(s.block_ids, 4, len(s.block_ids) * 4)) > 1
            bm.free(s)
        elif rng.random() < 0.4 or not live:
            s = seq(i, rng.randrange(1, 30), rng.choice([None, 8, 200]))
            if bm.needed(s, s.prompt_len) <= bm.num_free:
                bm.allocate(s, s.prompt_len)
                live.append(s)
        else:
            s = rng.choice(live)
            target = len(s.block_ids) * 4 + rng.randrange(1, 9)
            if bm.needed(s, target) <= bm.num_free:
                bm.allocate(s, target)
        owned = [b for s in live for b in s.block_ids]
        assert len(owned) == len(set(owned)) == 64 - bm.num_free
    assert split > 0, "the test never produced a split table"


def _attention_case(gqa: bool, dtype=torch.float32):
    torch.manual_seed(0)
    nh, nkv, hd, bs = 4, (2 if gqa else 4), 8, 4
    cache = KVCache(1, 40, bs, nkv, hd, dtype)
    cache.data.normal_()
    tables = [[3, 4, 5], [10, 0, 1, 7], [20], [30, 31, 12, 13, 14]]
    ctx = [11, 15, 2, 19]
    decode = [SeqWork(seq_id=i, token_ids=[1], start_pos=c - 1, block_ids=t, sample=True)
              for i, (t, c) in enumerate(zip(tables, ctx))]
    q = torch.randn(len(decode), nh, hd, dtype=dtype)
    k = torch.randn(len(decode), nkv, hd, dtype=dtype)
    v = torch.randn(len(decode), nkv, hd, dtype=dtype)
    return cache, decode, q, k, v, ctx, bs


def _dense_reference(cache, decode, q, k, v, ctx, bs):
    kc, vc = cache.data[0].clone()
    outs = []
    for i, w in enumerate(decode):
        slots = [w.block_ids[p // bs] * bs + p % bs for p in range(ctx[i])]
        kc[slots[-1]], vc[slots[-1]] = k[i], v[i]
        ks, vs = kc[slots].transpose(0, 1), vc[slots].transpose(0, 1)  # (nkv, L, hd)
        rep = q.shape[1] // ks.shape[0]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        p = torch.softmax((q[i][:, None] @ ks.transpose(1, 2)) / q.shape[-1] ** 0.5, dim=-1)
        outs.append((p @ vs)[:, 0])
    return torch.stack(outs)


def test_decode_strategies_agree_with_dense_attention():
    for gqa in (False, True):
        case = _attention_case(gqa)
        cache, decode, q, k, v, _ctx, bs = case
        ref = _dense_reference(*case)
        results = {}
        for batched in (False, True):
            c = KVCache(1, 40, bs, k.shape[1], q.shape[2], q.dtype)
            c.data.copy_(cache.data)
            results[batched] = PagedAttention(c, decode, [], torch.device("cpu"), batched_decode=batched)(0, q, k, v)
            assert (results[batched] - ref).abs().max() < 1e-5, (gqa, batched)
        assert results[False].shape == results[True].shape == q.shape
        assert F.mse_loss(results[False], results[True]) < 1e-10


def test_fragmented_tables_give_the_same_tokens(model_dir):
    """A pool too small for everyone's reservation splits tables; outputs equal a roomy run."""
    prompts = [list(range(5 + i, 30 + 2 * i)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLMEngine(model_dir, EngineConfig(num_kv_blocks=512, block_size=4))
    expect = {o.request_id: o.outputs[0].token_ids for o in _run(roomy, prompts, params)}

    tight = LLMEngine(model_dir, EngineConfig(num_kv_blocks=100, block_size=4, max_num_batched_tokens=64,
                                                  admission_reserves_growth=False))
    seen_split = []
    execute = tight.executor.execute

    def spy(plan):
        seen_split.extend(len(block_runs(w.block_ids, 4, w.start_pos + 1)) > 1 for w in plan.decode)
        return execute(plan)

    tight.executor.execute = spy
    got = {o.request_id: o.outputs[0].token_ids for o in _run(tight, prompts, params)}
    assert any(seen_split), "no decode step ran on a split block table"
    assert got == expect


def _run(engine: LLMEngine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = []
    while engine.has_unfinished_requests():
        final.extend(o for o in engine.step() if o.finished)
    return final


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_attends_in_fp32(dtype):
    """bf16 / fp16 decode on CPU attends each context in fp32 scratch (split tables, contexts of
    different lengths sharing it, GQA): the fp32 dense attention of the same low-precision inputs,
    to the output dtype's rounding."""
    for gqa in (False, True):
        cache, decode, q, k, v, ctx, bs = _attention_case(gqa, dtype)
        c32 = KVCache(1, 40, bs, k.shape[1], q.shape[2], torch.float32)
        c32.data.copy_(cache.data)
        ref = _dense_reference(c32, decode, q.float(), k.float(), v.float(), ctx, bs)
        out = PagedAttention(cache, decode, [], torch.device("cpu"), batched_decode=False)(0, q, k, v)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=1e-2)


@pytest.mark.parametrize("gqa", [False, True])
def test_batched_fresh_prefill_equals_one_prompt_at_a_time(gqa):
    """CUDA's padded batch of fresh prompts (forced here on CPU) = the per-prompt path, in a step that
    also holds decode rows and a later chunk of a long prompt (which keeps its own path)."""
    g = torch.Generator().manual_seed(3)
    nh, nkv, hd, bs = 4, (2 if gqa else 4), 8, 4
    decode = [SeqWork(seq_id=0, token_ids=[1], start_pos=6, block_ids=[0, 1], sample=True)]
    prefill = [SeqWork(seq_id=1, token_ids=[1] * 7, start_pos=0, block_ids=[2, 3], sample=True),
               SeqWork(seq_id=2, token_ids=[1] * 3, start_pos=0, block_ids=[4], sample=True),
               SeqWork(seq_id=3, token_ids=[1] * 5, start_pos=8, block_ids=[5, 6, 7, 8], sample=True),  # a later chunk
               SeqWork(seq_id=4, token_ids=[1] * 6, start_pos=0, block_ids=[9, 10], sample=True)]
    n = 1 + 7 + 3 + 5 + 6
    q = torch.randn(n, nh, hd, generator=g)
    k, v = torch.randn(n, nkv, hd, generator=g), torch.randn(n, nkv, hd, generator=g)
    base = torch.randn(1, 2, 16 * bs, nkv, hd, generator=g)  # earlier keys/values (the chunk's context)
    outs = {}
    for batched in (False, True):
        cache = KVCache(1, 16, bs, nkv, hd, torch.float32)
        cache.data.copy_(base)
        att = PagedAttention(cache, decode, prefill, torch.device("cpu"), batched_prefill=batched)
        assert (att.pf is not None) == batched and len(att.prefill) == (1 if batched else 4)
        outs[batched] = att(0, q.clone(), k.clone(), v.clone())
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    # and the fresh prompts are really attended (a prompt's last row differs from its first)
    assert not torch.allclose(outs[True][7], outs[True][1])


def _resident_bytes() -> int:
    """This process's resident anonymous memory (the KV cache's pages are anonymous): file pages, which the host
    may reclaim at any moment (mapped libraries, model files), would make a difference of two readings shrink."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise AssertionError("/proc/self/status has no RssAnon line")


def _populate_works() -> bool:
    from engines.cpu.host_memory import huge_page_zeros, populate

    probe = huge_page_zeros(2 << 20)
    return probe is not None and populate(probe, 0, 4096)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _populate_works(),
                    reason="madvise(MADV_POPULATE_WRITE) needs Linux 5.14+")
def test_prefault_maps_the_cache_without_changing_it():
    cache = KVCache(2, 1024, 16, 2, 64, torch.bfloat16)  # 16 MiB, untouched
    cache.data[1, 0, 5] = 3.0
    cache.data[0, 1, -1] = -2.0
    before = _resident_bytes()
    assert cache.prefault(1 << 20, 0) == 0 and not cache._prefaulted  # no block wanted: nothing mapped
    got = [cache.prefault(1 << 20, 1024)]
    while got[-1] < 1024:
        got.append(cache.prefault(1 << 20, 1024))
    # a 2 MiB piece a call, slab by slab (2 layers x keys, values of 4 MiB): blocks [0, n) mapped once every slab is
    assert got == [0, 0, 0, 512, 512, 512, 512, 1024] and cache.prefault(1 << 20, 1024) == 1024
    assert _resident_bytes() - before >= 0.9 * (cache.nbytes - (4 << 20))  # mapped now, bar the two 2 MiB pages written
    assert cache.data[1, 0, 5].eq(3.0).all() and cache.data[0, 1, -1].eq(-2.0).all()
    assert cache.data.float().abs().sum().item() == 128 * 3.0 + 128 * 2.0  # a row is 2 x 64; all else still zero


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _populate_works(),
                    reason="madvise(MADV_POPULATE_WRITE) needs Linux 5.14+")
def test_idle_engine_maps_its_cache_ahead_of_use_and_still_serves(gpt2_dir, monkeypatch):
    from engines import AsyncLLMEngine
    from engines.core import async_engine

    monkeypatch.setattr(async_engine, "PREFAULT_AHEAD", 64 << 10)  # a few blocks
    # sized from free memory (GiBs, untouched): mapped as used and ahead, not whole
    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig(kv_cache_memory_fraction=0.5))
    cache = engine.engine.executor.runner.cache
    per_block = cache.nbytes // cache.num_blocks
    longest = 64 * -(-engine.engine.max_model_len // 16)  # max_num_seqs sequences of the longest length
    ahead = engine._ahead_blocks
    assert ahead == min((64 << 10) // per_block, longest) < cache.num_blocks

    def mapped_to(n: int) -> int:  # wait until the idle loop has mapped blocks [0, n)
        deadline = time.monotonic() + 60
        while engine._mapped_to < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return engine._mapped_to

    try:
        assert mapped_to(ahead) == ahead and not cache._prefaulted  # PREFAULT_AHEAD's worth, not the whole cache
        assert ahead <= engine.engine.scheduler.blocks.mapped < cache.num_blocks  # told to the block manager

        async def main():
            outs = [o async for o in engine.generate("r", list(range(1, 200)),
                                                       SamplingParams(max_tokens=8, ignore_eos=True))]
            return outs[-1]

        out = asyncio.run(main())
        used = engine.engine.scheduler.blocks.high_water
        # after a busy period the window is at least twice what the period took (the next burst's fresh blocks)
        assert used > ahead and 3 * used < cache.num_blocks
        assert mapped_to(3 * used) == 3 * used  # (in 2 MiB pieces: this tiny cache was mapped by the first)
        assert engine._ahead_blocks == 2 * used
    finally:
        engine.shutdown()
    assert out.finished and len(out.outputs[0].token_ids) == 8


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _populate_works(),
                    reason="madvise(MADV_POPULATE_WRITE) needs Linux 5.14+")
def test_a_cache_the_user_sized_is_mapped_before_the_engine_serves(gpt2_dir):
    from engines import AsyncLLMEngine

    gc.collect()  # earlier tests' garbage freed now, not inside the window measured (their pages would leave RSS)
    before = _resident_bytes()
    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig(kv_cache_bytes=96 << 20))
    try:
        cache = engine.engine.executor.runner.cache
        assert engine.engine.cache_mapped and cache._prefaulted and engine.engine.scheduler.blocks.mapped == cache.num_blocks
        assert _resident_bytes() - before >= cache.nbytes  # the cache's pages and the model's

        async def main():
            return [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]

        assert len(asyncio.run(main())[-1].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_engine_keeps_freed_memory_for_its_next_step(gpt2_dir):
    """A CPU engine tells glibc to keep freed blocks (host_memory.retain_freed_memory): each step's activations
    then reuse the last step's memory instead of faulting fresh pages in. Checked in a fresh process, where nothing
    else (the training loop) has set it."""
    import subprocess

    code = ("import sys; from engines import LLM; from engines.cpu import host_memory as h\n"
            "assert h._done is None\n"
            f"LLM({str(gpt2_dir)!r}, num_kv_blocks=16)\n"
            "sys.exit(0 if h._done else 3)")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _populate_works(),
                    reason="madvise(MADV_POPULATE_WRITE) needs Linux 5.14+")
def test_idle_engine_stops_mapping_at_the_end_of_its_pool(gpt2_dir):
    """A mapping window wider than the pool (a small cache, or one a burst mostly took) ends at the pool's last
    block: the idle loop maps the whole cache once, then waits instead of asking prefault again and again (it
    spun on a core, and on the GIL, while idle)."""
    from engines import AsyncLLMEngine

    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig(kv_cache_memory_fraction=0.005))
    executor = engine.engine.executor
    cache = executor.runner.cache
    calls = [0]
    prefault = executor.prefault

    def counted(max_bytes: int, upto_block: int) -> int:
        calls[0] += 1
        return prefault(max_bytes, upto_block)

    executor.prefault = counted
    engine._ahead_blocks = 2 * cache.num_blocks  # the window past the pool's end
    engine._wake.set()  # (ends a wait begun before the wider window)
    try:
        deadline = time.monotonic() + 60
        while engine._mapped_to < cache.num_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._mapped_to == cache.num_blocks and cache._prefaulted
        before = calls[0]
        time.sleep(1.0)  # idle: two waits of the loop
        assert calls[0] == before, f"{calls[0] - before} prefault calls while idle with the whole pool mapped"

        async def main():
            return [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]

        assert asyncio.run(main())[-1].finished
    finally:
        engine.shutdown()
