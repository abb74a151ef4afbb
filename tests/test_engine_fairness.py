"""Fair scheduling: a burst larger than the KV cache finishes every request with bounded waits
(counted in engine steps, not seconds), on the engine's own Scheduler (pure Python)."""

from __future__ import annotations

import random

import pytest

from engines.core.plan import SeqResult, StepResult
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import Scheduler, SchedulerConfig
from engines.core.sequence import Sequence


def _burst(seed: int, n: int = 48, num_blocks: int = 60):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=128, block_size=4,
                                      num_blocks=num_blocks, max_model_len=256))
    seqs = {}
    for i in range(n):  # together they need ~10x the cache's 240 token slots
        p, m = rng.randint(8, 40), rng.randint(10, 80)
        seqs[i] = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[5] * p, prompt_len=p,
                           params=SamplingParams(max_tokens=m, ignore_eos=True))
        sched.add(seqs[i])
    last: dict[int, int] = {}
    first: dict[int, int] = {}
    gap = 0
    step = 0
    while sched.has_work:
        plan = sched.schedule()
        res = StepResult(step=plan.step)
        for w in (*plan.decode, *plan.prefill):
            if w.sample:
                res.seqs[w.seq_id] = SeqResult(token_id=7)
        for seq in sched.update(plan, res, seqs):
            if seq.seq_id in last:
                gap = max(gap, step - last[seq.seq_id])
            else:
                first[seq.seq_id] = step
            last[seq.seq_id] = step
        step += 1
        assert step < 20_000, "the burst did not drain"
    return seqs, first, gap, sched.num_preemptions


@pytest.mark.parametrize("seed", [0, 1])
def test_burst_larger_than_cache_never_stalls_a_stream(seed):
    seqs, first, gap, preemptions = _burst(seed)
    assert all(s.finished and s.num_output == s.params.max_tokens for s in seqs.values())
    # once a stream has its first token it gets one every step: admission reserved its growth
    assert gap == 1 and preemptions == 0
    # first tokens come in arrival order: nobody overtakes an older request (no starvation); one
    # step may give several their first token (the prompts share prefixes: cached ones start late)
    steps = [first[i] for i in sorted(first)]
    assert steps == sorted(steps)
