"""Admission by time to first token: refuse (429) what would wait past the model's TTFT SLO.

The count bound (`max_num_seqs + max_waiting` sequences per replica) keeps memory bounded but not
latency: at twice the capacity every admitted request waits for the whole queue ahead of it. With
`ttft_slo_ms` set, a replica predicts how long a new request would wait for its first token and
refuses it at once (429 + Retry-After) when that exceeds the SLO.

The prediction: a request that finds a free running slot (counting the sequences already queued
for the slots) starts with the next engine step, so it is always admitted: refusing it would not
make anyone faster (and a slow step, say a cold start, must never close the door). Otherwise it waits
until as many running sequences have finished as are queued ahead of it plus its own, at the rate
at which this replica has been starting sequences over the last seconds (with every slot busy,
each start is a slot some sequence gave back), and then one step for its prefill.

A model is a guess, and the SLO is on the tail. So the replica compares, for each admitted
request, the TTFT it got with the wait it was predicted and scales predictions by the 90th
percentile of that ratio over the window: a replica that keeps under-predicting refuses earlier.

And the SLO is a promise: an admitted request still queued in the engine is judged again while it
waits (`late`, every few milliseconds). Once the time it has waited plus what it still needs (by
the same model, from its place in the engine's queue, and at least one slow engine step for its
own prefill) passes the SLO, the replica gives it up and answers 429 with Retry-After, before any
token or stream header was sent, rather than a first token it knows will be late. The client
learns that early, not at the SLO, and a request that does get scheduled has a slow step's margin
left for its prefill, whatever the door's prediction missed. A request already scheduled is never
given up, nor one that a free slot takes with the next step (its first token is a step or two
away whatever happens; dropping it would only waste the work, and a cold start's slow steps must
not make every request late). Steps
are timed from the engine's own counters (`observe_steps`), over the same window as the rate.
"""

from __future__ import annotations

import collections
import time

WINDOW_S = 10.0
"""First tokens older than this do not count towards the rate."""
MIN_EVENTS = 4
"""Fewer first tokens than this in the window: no rate yet (waits beyond free slots unknown)."""
MIN_PREDICTED_S = 0.05
"""Predicted waits shorter than this are about one engine step: their error ratio is noise, not kept."""
CORRECTION_QUANTILE = 0.9
CORRECTION_RANGE = (0.5, 4.0)
"""Bounds of the correction factor (a few wild ratios must not close or open the door entirely)."""
STEP_WINDOW = 64
"""Engine step-time samples kept (each one the mean step between two looks at the counters)."""
STEP_QUANTILE = 0.9
"""The step a waiting request still needs is priced at this quantile of recent steps (prefill
steps are the long ones, and a request's first token comes from one)."""


class TtftAdmission:
    """Predicted wait for a first token, from the engine's queue, its start rate and step time."""

    def __init__(self, slo_s: float | None, max_running: int, clock=time.monotonic):
        self.slo_s = slo_s
        self.max_running = max_running
        self.clock = clock
        self.first_tokens: collections.deque[float] = collections.deque(maxlen=512)
        self.ratios: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        """(time, measured TTFT / predicted wait) of recently started (or given-up) requests."""
        self.steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=STEP_WINDOW)
        """(time, seconds per engine step) samples."""
        self._last_counters: tuple[int, float] | None = None

    # what the replica measured
    def rate(self) -> float | None:
        """Sequences started (first token) per second over the window (None: too few to tell)."""
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
                self.steps.append((self.clock(), d_busy / d_steps))
        self._last_counters = (num_steps, busy_s)

    def step_s(self, quantile: float = 0.5) -> float:
        """Engine step time at `quantile` over the window (0.0 when no step was seen in it)."""
        now = self.clock()
        while self.steps and now - self.steps[0][0] > WINDOW_S:
            self.steps.popleft()
        if not self.steps:
            return 0.0
        r = sorted(x for _, x in self.steps)
        return r[min(len(r) - 1, int(quantile * len(r)))]

    # predictions
    def _beyond_free(self, ahead: int, num_seqs: int, running: int) -> float | None:
        """Seconds until running sequences free a slot for each of `ahead` queued sequences and
        `num_seqs` more (0: there are free slots for all; None: no start rate measured yet)."""
        excess = ahead + num_seqs - max(0, self.max_running - running)
        if excess <= 0:
            return 0.0
        r = self.rate()
        return None if r is None else excess / r

    def predicted_wait_s(self, num_seqs: int, running: int, waiting: int) -> float:
        """Seconds a new request of `num_seqs` sequences would wait for its first token, before the
        correction, with `running` sequences in the engine and `waiting` queued for it."""
        wait = self._beyond_free(waiting, num_seqs, running)
        return self.step_s() + (wait or 0.0)

    def admits(self, num_seqs: int, running: int, waiting: int) -> bool:
        if self.slo_s is None:
            return True
        wait = self._beyond_free(waiting, num_seqs, running)
        if not wait:  # a free slot (starts next step), or queued with no rate yet (`late` judges it)
            return True
        return (self.step_s() + wait * self.correction()) <= self.slo_s

    def remaining_s(self, position: int | None, num_seqs: int, running: int) -> float:
        """Seconds an admitted request with no first token yet still needs: `position` sequences
        ahead of it in the engine's queue (None: it is scheduled already, its first token is one
        step away); at least one slow engine step either way."""
        floor = self.step_s(STEP_QUANTILE)
        if position is None:
            return floor
        wait = self._beyond_free(position, num_seqs, running)
        return floor + (wait or 0.0) * self.correction()

    def late(self, waited_s: float, position: int | None, num_seqs: int, running: int) -> bool:
        """Whether a request queued at `position` can no longer get its first token within the SLO
        (False once it is scheduled: position None)."""
        if self.slo_s is None or position is None or self._beyond_free(position, num_seqs, running) == 0.0:
            return False  # scheduled, or starts with the next step: waiting less is impossible
        return waited_s + self.remaining_s(position, num_seqs, running) > self.slo_s

    # bookkeeping, called by the replica
    def first_token(self, num_seqs: int, predicted_s: float = 0.0, measured_s: float = 0.0) -> None:
        """An admitted request of `num_seqs` sequences produced its first token (they start together)
        `measured_s` after it arrived, against the `predicted_s` of `predicted_wait_s`."""
        now = self.clock()
        self.first_tokens.extend([now] * num_seqs)
        if predicted_s >= MIN_PREDICTED_S:
            self.ratios.append((now, measured_s / predicted_s))

    def given_up(self, predicted_s: float, expected_s: float) -> None:
        """A waiting request was given up (`late`); `expected_s`: the TTFT it was heading for.
        Kept as a ratio like a measured one, so the door learns from the requests it misjudged
        (those never reach a first token to be measured by)."""
        if predicted_s >= MIN_PREDICTED_S:
            self.ratios.append((self.clock(), expected_s / predicted_s))
