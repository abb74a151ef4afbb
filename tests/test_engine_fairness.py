"""Fair scheduling: a burst larger than the KV cache finishes every request with bounded waits
(counted in engine steps, not seconds); a burst the cache takes whole is admitted shortest prompt first,
no request passed over more than admission_overtakes times; on the engine's own Scheduler (pure Python)."""

from __future__ import annotations

import random

import pytest

from engines.core.plan import SeqResult, StepResult
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import Scheduler, SchedulerConfig
from engines.core.sequence import Sequence


def _burst(seed: int, n: int = 48, num_blocks: int = 60, overtakes: int = 64):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=128, block_size=4,
                                      num_blocks=num_blocks, max_model_len=256, admission_overtakes=overtakes))
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


@pytest.mark.parametrize("overtakes", [64, 0], ids=["shortest-first", "arrival"])
@pytest.mark.parametrize("seed", [0, 1])
def test_burst_larger_than_cache_never_stalls_a_stream(seed, overtakes):
    seqs, first, gap, preemptions = _burst(seed, overtakes=overtakes)
    assert all(s.finished and s.num_output == s.params.max_tokens for s in seqs.values())
    # once a stream has its first token it gets one every step: admission reserved its growth
    assert gap == 1 and preemptions == 0
    # first tokens come in arrival order: nobody overtakes an older request (no starvation), shortest
    # first or not, as the cache cannot take every waiting request; one step may give several their
    # first token (the prompts share prefixes: cached ones start late)
    steps = [first[i] for i in sorted(first)]
    assert steps == sorted(steps)


def _admissions(lengths: list[int], overtakes: int, budget: int = 64, late: dict[int, int] | None = None):
    """Seq ids in the order the scheduler admits them (a burst of `lengths`, plus `late` {step: length}
    arriving at those steps), every request's blocks free, max_tokens 4."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, block_size=4,
                                      num_blocks=1024, max_model_len=512, admission_overtakes=overtakes))
    seqs: dict[int, Sequence] = {}

    def add(p: int) -> None:
        i = len(seqs)
        seqs[i] = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[5 + i] * p, prompt_len=p,
                           params=SamplingParams(max_tokens=4, ignore_eos=True))
        sched.add(seqs[i])

    for p in lengths:
        add(p)
    order, step = [], 0
    while sched.has_work:
        for p in [(late or {}).get(step)] if (late or {}).get(step) else []:
            add(p)
        plan = sched.schedule()
        order += [s.seq_id for s in plan.new_seqs]
        res = StepResult(step=plan.step, seqs={w.seq_id: SeqResult(token_id=7) for w in (*plan.decode, *plan.prefill)
                                               if w.sample})
        sched.update(plan, res, seqs)
        step += 1
    assert all(s.finished for s in seqs.values())
    return order


def test_burst_that_fits_is_admitted_shortest_prompt_first():
    lengths = [200, 20, 150, 40, 90, 10, 40]
    assert _admissions(lengths, overtakes=64) == [5, 1, 3, 6, 4, 2, 0]  # ties (40, 40) by arrival
    assert _admissions(lengths, overtakes=0) == list(range(len(lengths)))


def test_a_long_prompt_is_passed_over_at_most_admission_overtakes_times():
    # one 300-token prompt, then a short one arriving every step: shortest first would keep it waiting
    late = {step: 8 for step in range(40)}
    order = _admissions([300, 8], overtakes=3, budget=16, late=late)
    assert order.index(0) == 3  # after 3 later, shorter requests: then it goes next
    assert _admissions([300, 8], overtakes=0, budget=16, late=late)[0] == 0


def _prefill_steps(lengths: list[int], budget: int, whole: bool) -> list[list[tuple[int, bool]]]:
    """Every step's prefill rows as (seq id, whether the row finishes its prompt), for a burst of `lengths` (max_tokens
    8, shortest prompt first)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, block_size=4, num_blocks=4096,
                                      max_model_len=1024, whole_prompt_steps=whole))
    seqs: dict[int, Sequence] = {}
    for i, p in enumerate(lengths):
        seqs[i] = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[5 + i] * p, prompt_len=p,
                           params=SamplingParams(max_tokens=8, ignore_eos=True))
        sched.add(seqs[i])
    steps = []
    while sched.has_work:
        plan = sched.schedule()
        steps.append([(w.seq_id, w.sample) for w in plan.prefill])
        res = StepResult(step=plan.step, seqs={w.seq_id: SeqResult(token_id=7) for w in (*plan.decode, *plan.prefill)
                                               if w.sample})
        sched.update(plan, res, seqs)
        assert len(steps) < 10_000
    assert all(s.finished and s.num_output == 8 for s in seqs.values())
    return steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_that_runs_a_prompt_starts_no_prompt_it_cannot_finish(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(4, 60) for _ in range(40)] + [150, 200]  # two longer than the step's budget
    for whole in (True, False):
        steps = _prefill_steps(lengths, budget=64, whole=whole)
        # a chunk that does not finish its prompt shares its step with no other prompt: the first tokens of the
        # step's other prompts do not wait for it
        mixed = [rows for rows in steps if len(rows) > 1 and not all(done for _, done in rows)]
        assert (mixed == []) == whole, (whole, mixed[:3])
        # the prompts longer than the budget still run, in chunks
        assert sum(1 for rows in steps for i, _ in rows if i == 41) >= 4
