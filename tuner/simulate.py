"""Discrete-event simulation of one engine: the engine's own Scheduler, a cost model in place
of the executor, and the load tester's arrival processes.

Time only moves by step costs and arrival gaps; every request asks for exactly its output
length (ignore_eos), as the load tester's requests do. Prompts are distinct (the load tester's
random prompts share nothing) unless `shared_prefix_lens` gives each request a leading part
common to all requests (a chat's system prompt): the Scheduler's prefix cache (on unless the
SchedulerConfig turns it off) then skips the cached blocks of it, as the engine does.

A request's TPOT is what the load tester measures: from its first token to the last one the client
sees. A served replica streams tokens in chunks (tuner.stream: the first at once, then at most one
per stream interval), and the load tester (as vLLM's benchmark) stops a request's clock at
the last event that carries text: a final chunk whose tokens all decode to nothing does not count,
so the last token seen is the chunk before it. With a tokenizer that covers the model's
vocabulary that never happens; with the tuner's random-weight checkpoints (a 360-entry tokenizer
under 8,192 or 50,257 ids: 2.8% and 0.46% of sampled ids have text) it nearly always does, and a
request's measured TPOT lacks its final chunk: up to 20 ms of a 2 ms-per-token decode.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engines.core.plan import SeqResult, StepPlan, StepResult
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import Scheduler, SchedulerConfig
from engines.core.sequence import Sequence
from tuner.cost import StepWork
from tuner.stream import stream_intervals_s

_TOKEN = 1  # any non-EOS token id: the simulation never stops on EOS
_SHARED = 0  # the token of every shared prefix; request i's own tokens are _OWN + i
_OWN = 2


def work_of(plan: StepPlan) -> StepWork:
    """The StepWork of a scheduler plan (token counts, attention pairs, decode context)."""
    tokens = sampled = pairs = ctx = 0
    for w in plan.prefill:
        s, e = w.start_pos, w.start_pos + len(w.token_ids)
        tokens += e - s
        pairs += (e * (e + 1) - s * (s + 1)) // 2  # query at position p attends to p + 1 keys
        sampled += w.sample
    for w in plan.decode:
        tokens += 1
        ctx += w.start_pos + 1
        sampled += w.sample
    return StepWork(tokens=tokens, sampled=sampled, prefill_attn_pairs=pairs, decode_context=ctx,
                    seqs=len(plan.prefill) + len(plan.decode))


@dataclass
class RequestTrace:
    arrival: float
    input_len: int
    output_len: int
    token_times: list[float]
    seen_last: float | None = None
    """When the client sees the last token (expected value; see the module docstring): the final
    chunk's time, or the chunk's before it when the final one carries no text. None: the last token's."""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def last_seen(self) -> float:
        return self.token_times[-1] if self.seen_last is None else self.seen_last

    @property
    def e2e(self) -> float:
        return self.last_seen - self.arrival

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.last_seen - self.token_times[0]) / (n - 1) if n > 1 else 0.0


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: when it ran, what it computed, which sequences got a token."""

    start: float
    end: float
    work: StepWork
    sampled_ids: tuple[int, ...]


def simulate(step_cost: Callable[[StepWork], float], cfg: SchedulerConfig, arrivals: np.ndarray,
             input_lens: np.ndarray, output_lens: np.ndarray, max_steps: int = 10_000_000,
             request_overhead: float = 0.0, steps_out: list[StepRecord] | None = None,
             overhead_per_seq: float = 0.0, text_share: float = 1.0,
             shared_prefix_lens: np.ndarray | None = None) -> list[RequestTrace]:
    """Run every request to its last token; returns one trace per request, in input order.

    `request_overhead` (s) is spent outside the engine (gateway, Ray) before a request reaches
    the scheduler; its trace still starts at `arrivals`. `overhead_per_seq` (s) adds to it for
    every sequence the engine holds (running or waiting) when the request arrives: the serving
    side's own work per stream in flight (each one's tokens handed out every step) delays a new
    request's way in. `steps_out`, when given, receives every step (for the refit). `text_share`:
    the share of sampled token ids whose text is not empty (tuner.probe_model.text_token_share);
    below 1 each trace's seen_last is the client's expected last token (seen_last_times).
    `shared_prefix_lens[i]`: how many of request i's input_lens[i] tokens are a prefix common to
    every request (the rest is its own); None: none."""
    sched = Scheduler(cfg)
    arrivals = np.asarray(arrivals, dtype=float)
    seqs: dict[int, Sequence] = {}
    token_times: dict[int, list[float]] = {}
    order = np.argsort(arrivals, kind="stable")
    transit: list[tuple[float, int, int]] = []  # (time it reaches the engine, arrival rank, request) heap
    now, nxt, steps = 0.0, 0, 0
    n = len(order)
    while nxt < n or transit or sched.has_work:
        # requests that arrived by now (during the last step): their way in depends on what the
        # engine held then
        while nxt < n and arrivals[order[nxt]] <= now:
            i = int(order[nxt])
            held = len(sched.running) + len(sched.waiting)
            heapq.heappush(transit, (arrivals[i] + request_overhead + overhead_per_seq * held, nxt, i))
            nxt += 1
        while transit and transit[0][0] <= now:
            _, _, i = heapq.heappop(transit)
            params = SamplingParams(max_tokens=int(output_lens[i]), ignore_eos=True)
            length = int(input_lens[i])
            shared = min(int(shared_prefix_lens[i]), length) if shared_prefix_lens is not None else 0
            seq = Sequence(seq_id=i, request_id=str(i), index=0,
                           token_ids=[_SHARED] * shared + [_OWN + i] * (length - shared),
                           prompt_len=length, params=params)
            sched.check_fits(seq.prompt_len, params.max_tokens)
            seqs[i] = seq
            sched.add(seq)
        if not sched.has_work:
            now = float(min([arrivals[order[nxt]]] if nxt < n else [], default=np.inf))
            now = min(now, transit[0][0]) if transit else now
            continue
        plan = sched.schedule()
        if plan.empty:
            raise RuntimeError("the scheduler made no progress (KV cache too small for one request)")
        work = work_of(plan)
        start, now = now, now + step_cost(work)
        result = StepResult(step=plan.step, seqs={w.seq_id: SeqResult(token_id=_TOKEN)
                                                  for w in (*plan.decode, *plan.prefill) if w.sample})
        if steps_out is not None:
            steps_out.append(StepRecord(start, now, work, tuple(result.seqs)))
        for seq in sched.update(plan, result, seqs):
            token_times.setdefault(seq.seq_id, []).append(now)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps")
    traces = [RequestTrace(float(arrivals[i]), int(input_lens[i]), int(output_lens[i]), token_times.get(i, []))
              for i in range(n)]
    if text_share < 1.0:
        for tr, seen in zip(traces, seen_last_times(traces, text_share), strict=True):
            tr.seen_last = seen
    return traces


def seen_last_times(traces: list[RequestTrace], text_share: float) -> list[float | None]:
    """Each request's expected last token as the load tester sees it: the replica streams the first
    token at once, then a chunk at the first token at least stream_interval_s(requests active then)
    after the last chunk sent, and the rest in the final chunk; the client counts the final chunk
    only when one of its k tokens has text (probability 1 - (1 - text_share) ** k), else its last
    token is the chunk sent before it. A request is active from its arrival to its last token."""
    ends = np.sort([t.token_times[-1] for t in traces if t.token_times])
    starts = np.sort([t.arrival for t in traces])
    # the least interval at every token between a request's first and last, all requests at once (one
    # searchsorted per token took a sixth of each refit simulation)
    mids = np.array([t for tr in traces for t in tr.token_times[1:-1]], dtype=float)
    active = np.searchsorted(starts, mids, "right") - np.searchsorted(ends, mids, "left")
    intervals = stream_intervals_s(np.maximum(active, 1)).tolist()
    out: list[float | None] = []
    at = 0
    for tr in traces:
        times = tr.token_times
        if len(times) < 2:
            out.append(None)
            continue
        last_sent, k = times[0], len(times) - 1  # tokens after the last chunk sent
        for j, (t, interval) in enumerate(zip(times[1:-1], intervals[at:at + len(times) - 2], strict=True), start=1):
            if t - last_sent >= interval:
                last_sent, k = t, len(times) - 1 - j
        at += len(times) - 2
        p_text = 1.0 - (1.0 - min(max(text_share, 0.0), 1.0)) ** k
        out.append(p_text * times[-1] + (1.0 - p_text) * last_sent)
    return out


def summarize(traces: list[RequestTrace]) -> dict[str, float]:
    """Percentiles (ms) of TTFT, TPOT, ITL and E2E, output throughput (tokens/s) and request rate."""
    out: dict[str, float] = {}
    ttft = np.array([t.ttft for t in traces]) * 1e3
    tpot = np.array([t.tpot for t in traces if len(t.token_times) > 1]) * 1e3
    e2e = np.array([t.e2e for t in traces]) * 1e3
    itl = np.concatenate([np.diff(t.token_times) for t in traces]) * 1e3 if traces else np.zeros(0)
    for name, arr in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        if arr.size:
            out[f"{name}_mean_ms"] = float(arr.mean())
            for q in (50, 90, 95, 99):
                out[f"{name}_p{q}_ms"] = float(np.percentile(arr, q))
    start = min(t.arrival for t in traces)
    end = max(t.token_times[-1] for t in traces)
    out["duration_s"] = end - start
    out["output_throughput_tok_s"] = sum(len(t.token_times) for t in traces) / max(end - start, 1e-12)
    out["request_throughput_req_s"] = len(traces) / max(end - start, 1e-12)
    return out
