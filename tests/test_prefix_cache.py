"""Prefix caching in the engine: the same tokens with and without it (greedy and seeded, prompt
logprobs, multi-turn continuations), under preemption and abort, and with mixed p-tuning tasks
(a task's cached blocks never serve another task, the base model, or its own replaced table);
the hit counters reach /metrics; --no-prefix-caching turns it off."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engines import EngineConfig, SamplingParams
from engines.core.llm_engine import LLMEngine
from engines.transforms.ptuning import ModelShape, write_task_dir

_rng = random.Random(7)
SYS = [_rng.randrange(1, 300) for _ in range(37)]  # a "system prompt": 9 full blocks of 4
QUESTIONS = [[_rng.randrange(1, 300) for _ in range(_rng.randrange(3, 12))] for _ in range(6)]
BS = 4


def params(kind: str, i: int, **kw) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=8 + i % 3, ignore_eos=True, **kw)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=8 + i % 3,
                          ignore_eos=True, **kw)


def run(engine: LLMEngine, schedule: dict[int, list[tuple]], abort_after: dict[str, int] | None = None):
    """Requests (rid, prompt, params[, task]) join at their step; a request named in `abort_after`
    is aborted once it has that many tokens. Returns the final output of every request."""
    schedule, abort_after = dict(schedule), dict(abort_after or {})
    final, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in schedule):
        for rid, prompt, p, *task in schedule.pop(step, []):
            engine.add_request(rid, prompt, p, task=task[0] if task else None)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
            elif len(out.outputs[0].token_ids) >= abort_after.get(out.request_id, 1 << 30):
                final[out.request_id] = engine.abort_request(out.request_id)
        step += 1
    return final


def chat_schedule(kind: str) -> dict[int, list[tuple]]:
    """Six chats with one system prompt, joining at different steps; r3 wants prompt logprobs, r4
    repeats r0's prompt whole, r5 shares only part of the system prompt."""
    reqs = [(f"r{i}", SYS + q, params(kind, i)) for i, q in enumerate(QUESTIONS)]
    reqs[3] = ("r3", SYS + QUESTIONS[3], params(kind, 3, prompt_logprobs=2))
    reqs[4] = ("r4", SYS + QUESTIONS[0], params(kind, 4))
    reqs[5] = ("r5", SYS[:22] + QUESTIONS[5], params(kind, 5))
    return {0: reqs[:1], 1: reqs[1:3], 4: reqs[3:5], 9: reqs[5:]}


def engine(model_dir, caching: bool, **cfg) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(block_size=BS, max_num_batched_tokens=64, enable_prefix_caching=caching,
                                             **cfg))


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_same_tokens_with_and_without_caching(model_dir, kind):
    outs, hits = {}, {}
    for caching in (False, True):
        eng = engine(model_dir, caching)
        first = run(eng, chat_schedule(kind))
        # second turn: each chat's prompt + answer + a new question (hits the answer's blocks too)
        second = run(eng, {0: [(f"t{rid}", first[rid].prompt_token_ids + first[rid].outputs[0].token_ids + [5, 6, 7],
                                params(kind, 7)) for rid in ("r0", "r1", "r2")]})
        outs[caching] = {**first, **second}
        hits[caching] = eng.stats()["prefix_cache_hits"]
    off, on = outs[False], outs[True]
    assert {r: o.outputs[0].token_ids for r, o in on.items()} == {r: o.outputs[0].token_ids for r, o in off.items()}
    lp_on, lp_off = on["r3"].prompt_logprobs, off["r3"].prompt_logprobs
    assert len(lp_on) == len(SYS + QUESTIONS[3]) and lp_on[0] is None
    for a, b in zip(lp_on[1:], lp_off[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    assert hits[False] == 0 and all(o.num_cached_tokens == 0 for o in off.values())
    assert on["r0"].num_cached_tokens == 0 and on["r3"].num_cached_tokens == 0  # its rows are needed
    assert on["r1"].num_cached_tokens == on["r2"].num_cached_tokens == 36  # 9 blocks of the system prompt
    assert on["r4"].num_cached_tokens == (len(SYS + QUESTIONS[0]) - 1) // BS * BS  # all but the last token
    assert on["r5"].num_cached_tokens == 20
    assert on["tr0"].num_cached_tokens > len(SYS + QUESTIONS[0])  # the first answer's blocks too
    assert hits[True] == sum(o.num_cached_tokens for o in on.values())


def test_preemption_and_abort_with_shared_blocks(gpt2_dir):
    """A pool of 12 blocks for 5 chats that each need up to 10: preemption releases shared and
    private blocks, resumed sequences find cached ones again, an abort mid-stream releases its
    blocks; every other output equals a roomy run without caching, and the pool ends empty."""
    reqs = [(f"r{i}", SYS[:22] + q, params("seeded" if i % 2 else "greedy", i)) for i, q in enumerate(QUESTIONS[:5])]
    expect = run(engine(gpt2_dir, False), {0: reqs[:3], 3: reqs[3:]})
    tight = engine(gpt2_dir, True, num_kv_blocks=12, admission_reserves_growth=False, max_num_seqs=4)
    got = run(tight, {0: reqs[:3], 3: reqs[3:]}, abort_after={"r3": 2})
    sched = tight.scheduler
    assert sched.num_preemptions > 0 and tight.stats()["prefix_cache_hits"] > 0
    assert got["r3"].outputs[0].finish_reason == "abort" and len(got["r3"].outputs[0].token_ids) == 2
    assert got["r3"].num_cached_tokens == got["r4"].num_cached_tokens == 20  # the 5 blocks of SYS[:22]
    for rid in ("r0", "r1", "r2", "r4"):
        assert got[rid].outputs[0].token_ids == expect[rid].outputs[0].token_ids, rid
    assert sched.blocks.num_free == 12 and not sched.blocks._ref

    from prometheus_client.parser import text_string_to_metric_families

    from serving.metrics import ReplicaMetrics, render

    text = render(ReplicaMetrics("m", "r0", tight.stats).families()).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["shardserve_prefix_cache_hits_total"] == tight.stats()["prefix_cache_hits"] > 0
    assert samples["shardserve_prefix_cache_queries_total"] == tight.stats()["prefix_cache_queries"]


def _table(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1.0, (n, width)).astype(np.float32)


def test_ptuning_tasks_never_share_blocks(gpt2_dir, tmp_path):
    """One prompt under tasks a, b (input tables, as many virtual tokens), a task of every layer,
    and the base model: each gets its own outputs, hits only its own task's blocks, and a task
    whose table was replaced hits nothing of the old one."""
    shape = ModelShape.of(LLMEngine(gpt2_dir, EngineConfig(num_kv_blocks=4)).model_config)
    write_task_dir(tmp_path / "a", "a", _table(6, shape.hidden, 1))
    write_task_dir(tmp_path / "b", "b", _table(6, shape.hidden, 2))
    write_task_dir(tmp_path / "deep", "deep", _table(6, shape.prefix_width, 3), peft_type="PREFIX_TUNING",
                   shape=shape)
    prompt = SYS[:30]
    g = params("greedy", 0)
    first = {0: [("a1", prompt, g, "a")], 2: [("b1", prompt, g, "b"), ("base1", prompt, g)],
             3: [("deep1", prompt, g, "deep")], 6: [("a2", prompt, g, "a"), ("b2", prompt, g, "b")],
             7: [("base2", prompt, g), ("deep2", prompt, g, "deep")]}
    outs = {}
    for caching in (False, True):
        eng = engine(gpt2_dir, caching)
        for name in ("a", "b", "deep"):
            eng.tasks.load(name, tmp_path / name)
        got = run(eng, first)
        eng.tasks.load("a", tmp_path / "b")  # task a now has b's table: a new key, no stale hits
        got.update(run(eng, {0: [("a3", prompt, g, "a")]}))
        outs[caching] = got
    on, off = outs[True], outs[False]
    assert {r: o.outputs[0].token_ids for r, o in on.items()} == {r: o.outputs[0].token_ids for r, o in off.items()}
    distinct = {tuple(on[r].outputs[0].token_ids) for r in ("a1", "b1", "base1", "deep1")}
    assert len(distinct) == 4, "the tasks must change the output, or this test shows nothing"
    assert on["a3"].outputs[0].token_ids == on["b1"].outputs[0].token_ids
    full = (6 + len(prompt) - 1) // BS * BS  # virtual + real tokens, all but the last one
    for rid in ("a1", "b1", "base1", "deep1", "a3"):
        assert on[rid].num_cached_tokens == 0, rid
    for rid in ("a2", "b2", "deep2"):
        assert on[rid].num_cached_tokens == full, rid
    assert on["base2"].num_cached_tokens == (len(prompt) - 1) // BS * BS


def test_no_prefix_caching_flag(tmp_path, gpt2_dir):
    from typer.testing import CliRunner

    from engines.core.config import EngineConfig as EC
    from serving.cli import deployment_config
    from shardserve.cli import app

    cfg = deployment_config(None, gpt2_dir, no_prefix_caching=True)
    assert EC(**cfg.models[0].engine.engine_kwargs()).enable_prefix_caching is False
    assert EC(**deployment_config(None, gpt2_dir).models[0].engine.engine_kwargs()).enable_prefix_caching is True
    texts = []
    for flag in ([], ["--no-prefix-caching"]):
        res = CliRunner().invoke(app, ["generate", "--model", str(gpt2_dir), "--prompt", "to be or not",
                                       "--max-tokens", "6", "--temperature", "0", "--dtype", "float32", *flag])
        assert res.exit_code == 0, res.output
        texts.append(res.stdout)
    assert texts[0] == texts[1]
