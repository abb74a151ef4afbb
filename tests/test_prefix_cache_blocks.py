"""Prefix caching in the block manager and scheduler (pure Python): content keys, reference counts,
least-recently-released eviction, the never-the-whole-prompt rule, hit counters, and the tuner's
simulator seeing the hits."""

from __future__ import annotations

import dataclasses

import numpy as np

from engines.core.block_manager import BlockManager, cache_key
from engines.core.plan import SeqResult, StepResult
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import Scheduler, SchedulerConfig
from engines.core.sequence import Sequence

BS = 4


def seq(seq_id: int, tokens: list[int], key: bytes = b"", **params) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(tokens), prompt_len=len(tokens),
                    params=SamplingParams(max_tokens=4, **params), cache_key=key)


def computed(bm: BlockManager, s: Sequence, hits: list[int] | None = None) -> Sequence:
    """Admit `s` as the scheduler does (share its hits, allocate the rest) and mark it computed."""
    bm.share(s, hits if hits is not None else bm.match(s))
    bm.allocate(s, s.num_tokens)
    s.num_computed = s.num_tokens
    bm.cache_computed(s)
    return s


def test_shared_prefix_blocks_are_refcounted_and_never_the_whole_prompt():
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = computed(bm, seq(0, list(range(10))))  # 2 full blocks + 2 tokens
    assert bm.num_cached == 2 and bm.num_free == 32 - 3
    b = seq(1, list(range(8)) + [99, 98, 97])  # same first 2 blocks, then its own
    hits = bm.match(b)
    assert hits == a.block_ids[:2]
    assert bm.claim_cost(hits) == 0  # held by `a`: taking them uses no free block
    computed(bm, b, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.num_free == 32 - 4  # one new block for b
    # a prompt of exactly 2 cached blocks still computes its last block (the step needs logits)
    assert bm.match(seq(2, list(range(8)))) == a.block_ids[:1]
    assert bm.match(seq(3, list(range(7)))) == a.block_ids[:1]
    # the first block differs: nothing after it matches, although later blocks are equal
    assert bm.match(seq(4, [7, 1, 2, 3] + list(range(4, 12)))) == []
    a_own = a.block_ids[2]
    bm.free(a)
    assert bm._ref[b.block_ids[0]] == 1 and a_own not in bm._ref and bm.num_free == 32 - 3  # b still holds the shared blocks
    bm.free(b)
    assert bm.num_free == 32 and bm.usage == 0.0
    assert bm.num_cached == 2  # released, still cached
    c = seq(5, list(range(9)))
    hits = bm.match(c)
    assert len(hits) == 2 and bm.claim_cost(hits) == 2  # unheld cached blocks count as free ones
    computed(bm, c, hits)
    assert bm.num_free == 32 - 3


def test_cache_key_separates_tasks_and_prompt_logprobs_limit_hits():
    bm = BlockManager(num_blocks=32, block_size=BS)
    toks = list(range(13))
    computed(bm, seq(0, toks, key=cache_key("ptuning", "a", b"digest-a")))
    assert bm.match(seq(1, toks)) == []  # the base model never reads a task's blocks
    assert bm.match(seq(2, toks, key=cache_key("ptuning", "b", b"digest-a"))) == []
    assert bm.match(seq(3, toks, key=cache_key("ptuning", "a", b"digest-b"))) == []  # replaced table
    assert len(bm.match(seq(4, toks, key=cache_key("ptuning", "a", b"digest-a")))) == 3
    assert cache_key("ab", "c") != cache_key("a", "bc") and cache_key() == b""
    computed(bm, seq(5, toks))
    lp = seq(6, toks, prompt_logprobs=1)
    assert bm.match(lp) == []  # every prompt row is still needed for its logprob
    lp.prompt_logprobs_done = 9  # rows 0..8 returned already (before a preemption)
    assert len(bm.match(lp)) == 2


def test_eviction_is_least_recently_released_first_and_tail_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = computed(bm, seq(0, list(range(100, 112))))  # 3 full blocks
    b = computed(bm, seq(1, list(range(200, 208))))  # 2 full blocks
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)  # released first: evicted first, its deepest block before its first
    bm.free(b)
    assert list(bm._evictable) == a_blocks[::-1] + b_blocks[::-1]
    # a hit refreshes: b's first block is taken and released again, so it becomes the most recent
    c = computed(bm, seq(2, list(range(200, 204)) + [1, 2]))
    assert c.block_ids[0] == b_blocks[0]
    bm.free(c)
    assert list(bm._evictable)[-1] == b_blocks[0]
    # no empty run holds d (it expects 4 blocks; the 3 empty ones are scattered): one run instead, the
    # least recently released cached block (a's deepest) and the unheld blocks before it, in order
    d = seq(3, [9] * 10)
    bm.allocate(d, 10)
    assert d.block_ids == sorted(a_blocks) and bm.num_cached == 2
    assert bm.match(seq(5, list(range(200, 209)))) == b_blocks  # b's blocks, released later, survived
    # an empty run that holds a sequence is taken before any cached block
    e = seq(4, [8] * 3)
    bm.allocate(e, 3)
    assert bm.num_cached == 2 and not set(e.block_ids) & set(b_blocks)


def test_a_full_cache_still_places_each_sequence_in_one_run():
    # rounds of distinct prompts (nothing hits): from the third round no block is empty, every
    # free one is cached; taking the least recently released one at a time split each sequence
    # into one run per block (descending ids), which attention reads piece by piece
    bm = BlockManager(num_blocks=40, block_size=BS)
    for r in range(5):
        seqs = [computed(bm, seq(10 * r + i, [1000 * r + 100 * i + t for t in range(12)])) for i in range(3)]
        for s in seqs:
            bm.allocate(s, 16)  # grows by its 4 output tokens
            assert s.block_ids == list(range(s.block_ids[0], s.block_ids[0] + 4)), (r, s.block_ids)
        for s in seqs:
            s.num_computed = 16
            bm.cache_computed(s)
            bm.free(s)
    assert bm.num_cached == 40 and bm.num_free == 40


def test_a_lazily_mapped_pool_reuses_cold_cached_blocks_before_fresh_pages():
    # blocks [0, 8) mapped (the idle engine's prefault; the rest would fault on first write): a new prompt takes the
    # least recently released cached run below them, not the empty blocks above, and the recent content survives
    bm = BlockManager(num_blocks=32, block_size=BS)
    bm.mapped = 8
    a = computed(bm, seq(0, list(range(100, 112))))  # 3 full blocks + max_tokens 4: a run of 4
    b = computed(bm, seq(1, list(range(200, 212))))
    assert a.block_ids == [0, 1, 2] and b.block_ids == [4, 5, 6]  # first fit, inside the mapped blocks
    bm.free(a)
    bm.free(b)  # released last: the hotter content
    c = computed(bm, seq(2, [7] * 12))
    assert c.block_ids == [0, 1, 2] and bm.high_water == 7  # a's mapped blocks again, nothing fresh touched
    assert bm.match(seq(3, list(range(200, 213)))) == [4, 5, 6] and bm.match(seq(4, list(range(100, 113)))) == []
    # what the cold cached blocks cannot hold now goes to fresh blocks, in one run
    d = computed(bm, seq(5, [8] * 20))  # 5 blocks now, 6 expected: b's run [4, 8) is too short
    assert d.block_ids == list(range(7, 12)) and bm.match(seq(6, list(range(200, 213)))) == [4, 5, 6]
    # fully mapped (a device cache, a host that cannot map): plain first fit, cached content kept
    bm2 = BlockManager(num_blocks=32, block_size=BS)
    bm2.free(computed(bm2, seq(0, list(range(100, 112)))))
    assert computed(bm2, seq(1, [7] * 12)).block_ids == [3, 4, 5]
    assert bm2.match(seq(2, list(range(100, 113)))) == [0, 1, 2]


def _tokens(plan) -> StepResult:
    return StepResult(plan.step, {w.seq_id: SeqResult(token_id=7) for w in (*plan.decode, *plan.prefill) if w.sample})


def test_scheduler_counts_hits_and_skips_cached_tokens():
    """A request whose prompt shares 3 blocks with an earlier one computes only the rest."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_blocks=32,
                                      max_model_len=64))
    seqs = {}
    prompts = [list(range(14)), list(range(12)) + [50, 51, 52]]
    for i, p in enumerate(prompts):
        seqs[i] = seq(i, p)
        sched.add(seqs[i])
        plan = sched.schedule()
        (work,) = plan.prefill
        sched.update(plan, _tokens(plan), seqs)
        assert work.start_pos == (0 if i == 0 else 12) and len(work.token_ids) == len(p) - work.start_pos
    assert seqs[1].num_cached_tokens == 12 and seqs[0].num_cached_tokens == 0
    assert sched.blocks.query_tokens == 14 + 15 and sched.blocks.hit_tokens == 12
    off = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_blocks=32,
                                    max_model_len=64, enable_prefix_caching=False))
    for i, p in enumerate(prompts):
        s = seq(i, p)
        off.add(s)
        plan = off.schedule()
        off.update(plan, _tokens(plan), {i: s})
        assert plan.prefill[0].start_pos == 0
    assert off.blocks.hit_tokens == off.blocks.query_tokens == 0 and off.blocks.num_cached == 0


def test_simulator_models_shared_prefix_hits():
    from tuner.simulate import simulate

    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, block_size=16, num_blocks=512,
                          max_model_len=1024)
    arr, ins, outs = np.arange(8) * 0.05, np.full(8, 300), np.full(8, 4)
    shared = np.full(8, 256)

    def prefill_tokens(c, **kw):
        steps = []
        simulate(lambda w: 1e-3 + 1e-5 * w.tokens, c, arr, ins, outs, steps_out=steps, **kw)
        return sum(s.work.tokens for s in steps)

    distinct = prefill_tokens(cfg)
    assert distinct == 8 * (300 + 3)  # distinct prompts (the default) share nothing
    assert prefill_tokens(cfg, shared_prefix_lens=shared) == distinct - 7 * 256  # 256 = 16 cached blocks
    off = dataclasses.replace(cfg, enable_prefix_caching=False)
    assert prefill_tokens(off, shared_prefix_lens=shared) == distinct


def test_reset_forgets_cached_content_and_keeps_held_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = computed(bm, seq(0, list(range(10))))  # held: 2 cached full blocks
    b = computed(bm, seq(1, [7] * 9))  # 2 more cached blocks
    bm.free(b)  # its cached blocks are now evictable
    free_before = bm.num_free
    assert bm.reset_prefix_cache() == 4 and bm.num_cached == 0
    assert bm.num_free == free_before  # nothing held was released, nothing free was lost
    assert bm.match(seq(2, [7] * 9)) == [] and bm.match(seq(3, list(range(10)))) == []
    held = list(a.block_ids)
    c = computed(bm, seq(4, [7] * 9))  # the pool still works: new blocks, cached again
    assert not set(c.block_ids) & set(held) and bm.num_cached == 2
    bm.free(a)
    assert bm.num_free == 16 - len(c.block_ids)
