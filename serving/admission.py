"""Admission by time to first token: refuse (429) what would wait past the model's TTFT SLO.

The count bound (`max_num_seqs + max_waiting` sequences per replica) keeps memory bounded but not
latency: at twice the capacity every admitted request waits for the whole queue ahead of it. With
`ttft_slo_ms` set, a replica also predicts how long a new request would wait for its first token
and refuses it at once (429 + Retry-After) when that exceeds the SLO, so the requests it does admit
keep their TTFT. The prediction is Little's law on what the replica measured itself: the sequences
admitted ahead of the request that have no first token yet, divided by the rate at which sequences
got their first token over the last few seconds. Nothing is predicted while the replica has a free
running slot and an empty queue, or before it has seen enough first tokens to know its rate.

Little's law gives the mean; the SLO is on the tail, and a request admitted just before a slow step
waits for it. So the replica also compares, for each admitted request, the TTFT it got with the wait
it was predicted, and scales predictions by the 90th percentile of that ratio over the window: a
replica that keeps under-predicting refuses earlier, one that over-predicts admits more.

A prediction at the door is still a guess, and the SLO is a promise. So an admitted request that
has no first token yet is judged again while it waits (`late`, every few milliseconds): once the
time it has waited plus what it still needs (its place in the queue over the start rate, and at
least one engine step for its own prefill) passes the SLO, the replica gives it up and answers 429
with Retry-After, before any token or stream header was sent, rather than a first token it knows
will be late. The client learns that early (not at the SLO), and the requests that do get a first
token get it within the SLO whatever the predictor missed. Steps are timed from the engine's own
counters (`observe_steps`): the median step of the last seconds, and the slow tail of them for
the step a request still needs.
"""

from __future__ import annotations

import collections
import time

WINDOW_S = 10.0
"""First tokens older than this do not count towards the rate."""
MIN_EVENTS = 4
"""Fewer first tokens than this in the window: no rate yet, admit on the count bound alone."""
MIN_PREDICTED_S = 0.05
"""Predicted waits shorter than this are one engine step: their error ratio is noise, not kept."""
CORRECTION_QUANTILE = 0.9
CORRECTION_RANGE = (0.5, 4.0)
"""Bounds of the correction factor (a few wild ratios must not close or open the door entirely)."""
STEP_WINDOW = 64
"""Engine step-time samples kept (each one the mean step between two looks at the counters)."""
STEP_QUANTILE = 0.9
"""The step a waiting request still needs is priced at this quantile of recent steps (prefill
steps are the long ones, and a request's first token comes from one)."""


class TtftAdmission:
    """Predicted wait for a first token, from the queue ahead and the measured start rate."""

    def __init__(self, slo_s: float | None, max_running: int, clock=time.monotonic):
        self.slo_s = slo_s
        self.max_running = max_running
        self.clock = clock
        self.queued = 0
        """Sequences admitted that have not produced a first token yet."""
        self.first_tokens: collections.deque[float] = collections.deque(maxlen=512)
        self.ratios: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        """(time, measured TTFT / predicted wait) of recently started requests."""
        self.steps: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        """Seconds per engine step, recent samples."""
        self._last_counters: tuple[int, float] | None = None

    def rate(self) -> float | None:
        """First tokens per second over the window (None: too few to tell)."""
        now = self.clock()
        while self.first_tokens and now - self.first_tokens[0] > WINDOW_S:
            self.first_tokens.popleft()
        if len(self.first_tokens) < MIN_EVENTS:
            return None
        span = max(now - self.first_tokens[0], 1e-3)
        return len(self.first_tokens) / span

    def correction(self) -> float:
        """Factor applied to predictions: the 90th percentile of measured / predicted (1.0: too few)."""
        now = self.clock()
        while self.ratios and now - self.ratios[0][0] > WINDOW_S:
            self.ratios.popleft()
        if len(self.ratios) < MIN_EVENTS:
            return 1.0
        r = sorted(x for _, x in self.ratios)
        q = r[min(len(r) - 1, int(CORRECTION_QUANTILE * len(r)))]
        return min(CORRECTION_RANGE[1], max(CORRECTION_RANGE[0], q))

    def observe_steps(self, num_steps: int, busy_s: float) -> None:
        """Feed the engine's cumulative step count and busy seconds (called every few milliseconds)."""
        if self._last_counters is not None:
            d_steps, d_busy = num_steps - self._last_counters[0], busy_s - self._last_counters[1]
            if d_steps > 0 and d_busy >= 0:
                self.steps.append(d_busy / d_steps)
        self._last_counters = (num_steps, busy_s)

    def step_s(self, quantile: float = 0.5) -> float:
        """Recent engine step time at `quantile` (0.0 before any step was seen)."""
        if not self.steps:
            return 0.0
        r = sorted(self.steps)
        return r[min(len(r) - 1, int(quantile * len(r)))]

    def predicted_wait_s(self, num_seqs: int, running: int) -> float:
        """Seconds a request of `num_seqs` sequences would wait for its first token, before the
        correction: one engine step when a running slot is free and nobody queues ahead."""
        if self.queued == 0 and running + num_seqs <= self.max_running:
            return self.step_s()
        r = self.rate()
        return self.step_s() if r is None else max(self.step_s(), (self.queued + num_seqs) / r)

    def remaining_s(self, ahead: int, num_seqs: int) -> float:
        """Seconds an admitted request still waiting, with `ahead` sequences admitted before it and
        no first token yet, needs for its own: its turn by the start rate (corrected), and at
        least one slow engine step."""
        floor = self.step_s(STEP_QUANTILE)
        r = self.rate()
        return floor if r is None else max(floor, (ahead + num_seqs) / r * self.correction())

    def late(self, waited_s: float, ahead: int, num_seqs: int) -> bool:
        """Whether a waiting request can no longer get its first token within the SLO."""
        return self.slo_s is not None and waited_s + self.remaining_s(ahead, num_seqs) > self.slo_s

    def admits(self, num_seqs: int, running: int) -> bool:
        return self.slo_s is None or self.predicted_wait_s(num_seqs, running) * self.correction() <= self.slo_s

    # bookkeeping, called by the replica
    def admitted(self, num_seqs: int, running: int) -> float:
        """Count an admitted request in the queue; returns its predicted wait (for `first_token`)."""
        predicted = self.predicted_wait_s(num_seqs, running)
        self.queued += num_seqs
        return predicted

    def first_token(self, num_seqs: int, predicted_s: float = 0.0, measured_s: float = 0.0) -> None:
        """An admitted request of `num_seqs` sequences produced its first token (they start together)
        `measured_s` after it arrived, against the `predicted_s` that `admitted` returned."""
        self.queued = max(0, self.queued - num_seqs)
        now = self.clock()
        self.first_tokens.extend([now] * num_seqs)
        if predicted_s >= MIN_PREDICTED_S:
            self.ratios.append((now, measured_s / predicted_s))

    def left(self, num_seqs: int) -> None:
        """An admitted request ended (failed, aborted, refused) before its first token."""
        self.queued = max(0, self.queued - num_seqs)

    def given_up(self, predicted_s: float, expected_s: float) -> None:
        """A waiting request was given up (`late`); `expected_s`: the TTFT it was heading for.
        Kept as a ratio like a measured one, so the door learns from the requests it misjudged
        (those never reach a first token to be measured by). Call `left` as well."""
        if predicted_s >= MIN_PREDICTED_S:
            self.ratios.append((self.clock(), expected_s / predicted_s))
