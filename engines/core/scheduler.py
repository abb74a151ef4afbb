"""Continuous batching: which tokens of which sequences run in the next step.

Pure Python (no torch), so the tuner's simulator runs this very class with a cost model.
Each step: running sequences first (decode, or the next chunk of a long prompt), oldest request
first; when KV blocks run out, the *youngest* running sequence by arrival (not by admission) is
preempted (its blocks are freed and it is recomputed later) and goes back to the waiting queue in
arrival order, ahead of every request that arrived after it; then waiting sequences are admitted
while the token budget, the sequence cap and the free blocks allow. An admitted sequence starts
after the longest prefix of its tokens whose blocks are cached (prefix caching,
engines/core/block_manager.py): those tokens are neither computed nor counted against the budget, and
a resumed preempted sequence finds its own blocks again if nothing evicted them. Blocks are
registered in the cache in update(), once their keys and values are computed.

Which waiting sequence goes next: while the sequence cap and the free KV blocks take every waiting
request whole (their growth reserved), the one with the fewest tokens (shortest prompt first, ties by
arrival), except that a preempted one, or one that later arrivals have passed over
`admission_overtakes` times, goes first (oldest first). Otherwise, in arrival order: a request passed
over for memory or a slot would wait for whole requests to end, not for a prefill. In a burst, short
prompts no longer queue behind long ones: 64 prompts of 16-256 tokens at once (this class under a cost
model of a 2-core fp32 SmolLM2, 2,048-token steps, 30 draws) got their first tokens 20 % sooner on
average (6.93 -> 5.52 s), the 90th percentile 2.6 % sooner (11.10 -> 10.81 s: first tokens come at the
end of 2,048-token steps, so a percentile moves a whole step or not at all) and the last one when it
always did (every prompt prefilled).

A step that already prefills a prompt starts no prompt it cannot finish (`whole_prompt_steps`): a first token
comes at the end of the step that finishes its prompt, so the next prompt's first chunk would hold back every
prompt the step finishes and give nobody a token. Chunked prefill still splits a prompt alone in its step (with
the decodes), which is how a prompt longer than the budget runs.

Why arrival order and not admission order for preemption: a resumed sequence is the most recently
admitted one, so admission-order (LIFO) preemption picks it again and again while younger streams
run, and it starves (a 52 s mid-stream stall in a 64-stream burst). With arrival order the oldest
running request always progresses. Sequence ids are handed out in arrival order, so they are the
priority.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from engines.core.block_manager import BlockManager, blocks_for
from engines.core.plan import SeqInit, SeqWork, StepPlan, StepResult
from engines.core.sampling_params import RequestError
from engines.core.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    admission_reserves_growth: bool = True
    """Admit a request only when the free blocks also cover what the running sequences will still
    grow by (no mid-stream preemption of requests with max_tokens); off admits on what a request
    needs now (more concurrency, recompute preemption under pressure)."""
    enable_prefix_caching: bool = True
    """Reuse the cached keys and values of the longest cached prefix of a new (or resumed)
    sequence's tokens (engines/core/block_manager.py)."""
    admission_overtakes: int = 64
    """Shortest prompt first among waiting requests, but a waiting request is passed over by at most
    this many later arrivals before it goes next; 0: arrival order (first come, first served)."""
    whole_prompt_steps: bool = True
    """A step that already runs a prompt does not start one it cannot finish (chunked prefill then
    splits only a prompt that is alone, or behind decodes only, in its step); off: the budget's rest
    goes to the next waiting prompt's first chunk."""


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.max_model_len, cfg.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self._step = 0
        self.num_preemptions = 0

    # admission
    def check_fits(self, prompt_len: int, max_tokens: int | None) -> None:
        """Reject, with a clear reason, a request that could never run."""
        limit = self.cfg.max_model_len
        if prompt_len >= limit:
            raise RequestError(
                f"prompt: {prompt_len} tokens leave no room to generate within the context window of "
                f"{limit} tokens", param="prompt", code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise RequestError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"window of {limit} tokens", param="max_tokens", code="context_length_exceeded")
        total = min(limit, prompt_len + (max_tokens if max_tokens is not None else limit))
        need = blocks_for(total, self.cfg.block_size)
        if need > self.cfg.num_blocks:
            room = self.cfg.num_blocks * self.cfg.block_size - prompt_len
            asked = (f"max_tokens ({max_tokens})" if max_tokens is not None else
                     f"max_tokens (not set: up to the context window of {limit} tokens)")
            fix = f"set max_tokens <= {room}" if room > 0 else "shorten the prompt"
            raise RequestError(
                f"max_tokens: the prompt ({prompt_len} tokens) + {asked} need {need} KV blocks ({total} tokens) but "
                f"the KV cache has only {self.cfg.num_blocks} blocks of {self.cfg.block_size} tokens; {fix} or raise "
                "the KV-cache budget", param="max_tokens", code="kv_cache_too_small")

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (stop string, abort, ...): its blocks are free at once."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.worker_has_state:
            self._released.append(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # planning
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # back in arrival order: only earlier preempted sequences can be older than seq
        i = 0
        while i < len(self.waiting) and self.waiting[i].seq_id < seq.seq_id:
            i += 1
        self.waiting.insert(i, seq)

    def schedule(self, max_steps: int = 1) -> StepPlan:
        """The next step's plan. max_steps > 1: where every scheduled row decodes, is plain greedy, and nothing waits,
        a plan of up to max_steps decode steps (multi-step decode, `_steps`)."""
        plan = StepPlan(step=self._step)
        self._step += 1
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while self.blocks.needed(seq, seq.num_computed + n) > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq was the last running one and was preempted
            self.blocks.allocate(seq, seq.num_computed + n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        # admission reserves what the running sequences will still grow by, so that a new request
        # does not take blocks that force a running one out later (which would stall its stream);
        # with nothing running, the first in admission order is admitted on what it needs now
        order: list[Sequence] = []
        prefills = False  # whether a prompt (or a chunk of one) runs in this step
        if self.waiting and not preempted:  # (a decode step with no one waiting: no sum over the running)
            room = self.blocks.num_free - sum(self.blocks.growth(s) for s in self.running)
            order = self._admission_order(room)
            prefills = any(n > 1 or seq.num_computed == 0 for seq, n in scheduled)
        for seq in order:
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            hits = self.blocks.match(seq)  # a waiting sequence holds no blocks and has none computed
            cached = len(hits) * self.cfg.block_size
            n = min(seq.num_tokens - cached, budget)
            if n < seq.num_tokens - cached and self.cfg.whole_prompt_steps and prefills:
                break  # its first chunk would delay the first tokens of this step's prompts (see the docstring)
            # free blocks it takes: new ones, and cached ones that no running sequence holds now
            claim = self.blocks.claim_cost(hits)
            if blocks_for(cached + n, self.cfg.block_size) - len(hits) + claim > self.blocks.num_free:
                break
            whole = self.blocks.growth(seq) - len(hits) + claim
            if self.cfg.admission_reserves_growth and self.running and whole > room:
                break  # nothing after it in the order goes first, so it cannot starve
            room -= whole
            self._take(seq)
            self.blocks.share(seq, hits)
            seq.num_computed = cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
            self.blocks.allocate(seq, cached + n)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)  # a resumed sequence rejoins by age
            scheduled.append((seq, n))
            prefills = True
            budget -= n
        if max_steps > 1 and scheduled and not self.waiting and not preempted:
            plan.steps = self._steps(scheduled, max_steps)
        for seq, n in scheduled:
            start = seq.num_computed
            end = start + n
            work = SeqWork(seq_id=seq.seq_id, token_ids=seq.token_ids[start:end], start_pos=start,
                           block_ids=list(seq.block_ids), sample=end == seq.num_tokens,
                           **self._prompt_lp(seq, start, end))
            if n == 1 and start > 0:
                plan.decode.append(work)
            else:
                plan.prefill.append(work)
            if not seq.worker_has_state:
                plan.new_seqs.append(SeqInit(seq.seq_id, seq.index, seq.params, seq.token_ids[:seq.prompt_len],
                                             self.cfg.eos_token_ids))
                seq.worker_has_state = True
        plan.released_seq_ids, self._released = self._released, []
        return plan

    def _steps(self, scheduled: list[tuple[Sequence, int]], max_steps: int) -> int:
        """Decode steps of a plan whose rows may run several (multi-step decode: a worker feeds each drawn token to the
        next step itself, with no scheduler, sampler or interpreter between them; engines/runner/model_runner.py): at
        most max_steps, none past a row's max_tokens or the context window, with the blocks of every step allocated
        now (fewer steps where the free blocks run short); 1 where a row prefills or is not plain greedy. A row's
        stop token or stop string ends its run early: update() drops the tokens after it."""
        if any(n != 1 or seq.num_computed == 0 or not seq.params.plain_greedy for seq, n in scheduled):
            return 1
        k = max_steps
        for seq, _ in scheduled:
            p = seq.params
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - seq.num_output)
            k = min(k, self.cfg.max_model_len - seq.num_tokens)
        while k > 1 and sum(self.blocks.needed(seq, seq.num_computed + k) for seq, _ in scheduled) > self.blocks.num_free:
            k //= 2
        if k <= 1:
            return 1
        for seq, _ in scheduled:
            self.blocks.allocate(seq, seq.num_computed + k)
        return k

    def _admission_order(self, room: int) -> list[Sequence]:
        """The waiting sequences in the order admission tries them (see the module docstring): shortest first only
        while the sequence cap and the free blocks (less what the running ones will still grow by) take every
        waiting request whole; then the order decides only whose prefill runs first. Otherwise in arrival order: a
        request passed over for memory or a slot would wait for whole requests to end (a burst of 10x the cache on
        shortest first: the first request's first token came after 510 steps instead of at once)."""
        limit = self.cfg.admission_overtakes
        if (limit <= 0 or len(self.waiting) < 2
                or len(self.running) + len(self.waiting) > self.cfg.max_num_seqs
                or sum(self.blocks.growth(s) for s in self.waiting) > room):
            return list(self.waiting)

        def key(s: Sequence) -> tuple[int, int]:
            due = s.num_preemptions > 0 or s.overtaken >= limit
            return (0, s.seq_id) if due else (1 + s.num_tokens, s.seq_id)

        return sorted(self.waiting, key=key)

    def _take(self, seq: Sequence) -> None:
        """Remove `seq` from the waiting queue; every older request still waiting was overtaken once."""
        if self.waiting[0] is seq:
            self.waiting.popleft()
            return
        self.waiting.remove(seq)
        for older in self.waiting:
            if older.seq_id > seq.seq_id:
                break  # the queue is in arrival order
            older.overtaken += 1

    @staticmethod
    def _prompt_lp(seq: Sequence, start: int, end: int) -> dict:
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return {}
        # rows at positions i score prompt token i + 1; skip those returned before a preemption
        first = max(start, seq.prompt_logprobs_done)
        last = min(end, seq.prompt_len - 1)
        if first >= last:
            return {}
        seq.prompt_logprobs_done = last
        return {"prompt_lp_from": first, "prompt_lp_targets": seq.token_ids[first + 1:last + 1]}

    def update(self, plan: StepPlan, result: StepResult, seqs: dict[int, Sequence],
               token=lambda r: r.token_at(0)) -> list[Sequence]:
        """Advance the sequences of `plan` with the sampled tokens; returns those that got a token. token: a row's
        token of its SeqResult (one of a multi-step plan's: engines/core/llm_engine.py takes them one step at a time).

        Token-level stops happen here (EOS, stop token ids, max_tokens, context window); stop
        strings need text and are applied by the engine through finish().
        """
        touched = []
        for work in (*plan.decode, *plan.prefill):
            seq = seqs.get(work.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = work.start_pos + len(work.token_ids)
            self.blocks.cache_computed(seq)  # before a finish below releases its blocks
            if not work.sample:
                continue
            tok = token(result.seqs[work.seq_id])
            seq.token_ids.append(tok)
            touched.append(seq)
            p = seq.params
            can_stop = seq.num_output >= p.min_tokens
            if can_stop and not p.ignore_eos and tok in self.cfg.eos_token_ids:
                self.finish(seq, "stop", None)
            elif can_stop and tok in p.stop_token_ids:
                self.finish(seq, "stop", tok)
            elif ((p.max_tokens is not None and seq.num_output >= p.max_tokens)
                  or seq.num_tokens >= self.cfg.max_model_len):
                self.finish(seq, "length")
        return touched
