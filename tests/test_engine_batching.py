"""Continuous batching, chunked prefill, paged KV cache and preemption keep outputs exact."""

from __future__ import annotations

import random

import pytest

from engines import EngineConfig, SamplingParams
from engines.core.llm_engine import LLMEngine

TARGET = list(range(20, 57))
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)


def run_all(engine: LLMEngine, schedule: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Add requests at the given step numbers and run until all are done; returns final outputs."""
    final, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in schedule):
        for rid, prompt, params in schedule.pop(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    return final


def alone(model_dir, params, **cfg):
    engine = LLMEngine(model_dir, EngineConfig(**cfg))
    return run_all(engine, {0: [("t", TARGET, params)]})["t"].outputs[0].token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batch_invariance(model_dir, params):
    """Alone, or among 15 others of different lengths admitted at different steps: same tokens."""
    expect = alone(model_dir, params)
    rng = random.Random(0)
    engine = LLMEngine(model_dir, EngineConfig(max_num_batched_tokens=64))
    schedule: dict[int, list] = {}
    for i in range(15):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 90))]
        other = SamplingParams(temperature=rng.choice([0, 0.7, 1.2]), max_tokens=rng.randrange(1, 40),
                               ignore_eos=True, seed=rng.choice([None, i]))
        schedule.setdefault(rng.randrange(0, 12), []).append((f"o{i}", prompt, other))
    schedule.setdefault(5, []).append(("t", TARGET, params))
    final = run_all(engine, schedule)
    assert len(final) == 16
    assert final["t"].outputs[0].token_ids == expect


def test_chunked_prefill_matches_whole_prefill(model_dir):
    whole = alone(model_dir, GREEDY)
    chunked = alone(model_dir, GREEDY, max_num_batched_tokens=8)
    assert chunked == whole


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_resumes_identically(model_dir, params):
    prompts = [list(range(10 + i, 50 + 3 * i)) for i in range(6)]
    ample = LLMEngine(model_dir, EngineConfig())
    expect = run_all(ample, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    tight = LLMEngine(model_dir, EngineConfig(num_kv_blocks=12, block_size=8, admission_reserves_growth=False))
    got = run_all(tight, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert tight.scheduler.num_preemptions > 0
    for rid in expect:
        assert got[rid].outputs[0].token_ids == expect[rid].outputs[0].token_ids
    assert tight.scheduler.blocks.num_free == 12


def test_scheduler_respects_limits(gpt2_dir):
    engine = LLMEngine(gpt2_dir, EngineConfig(max_num_seqs=3, max_num_batched_tokens=20))
    for i in range(6):
        engine.add_request(f"r{i}", list(range(5, 35)), GREEDY)
    seen_seqs, seen_tokens = 0, 0
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        seen_seqs = max(seen_seqs, len(plan.decode) + len(plan.prefill))
        seen_tokens = max(seen_tokens, plan.num_tokens)
        result = engine.executor.execute(plan)
        engine.scheduler.update(plan, result, engine._seqs)
        for rid, req in list(engine.requests.items()):
            if req.finished:
                del engine.requests[rid]
    assert seen_seqs == 3
    assert seen_tokens == 20


def test_paged_cache_holds_more_than_slots(gpt2_dir):
    """Blocks are allocated as sequences grow, not reserved for the maximum length."""
    engine = LLMEngine(gpt2_dir, EngineConfig(num_kv_blocks=40, block_size=8, max_num_seqs=64))
    for i in range(20):
        engine.add_request(f"r{i}", list(range(1, 10)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    # one max-length (256-token) slot per sequence would hold 320 / 256 = 1 sequence
    assert len(engine.scheduler.running) == 20
