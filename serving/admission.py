"""Admission by time to first token: refuse (429) what would wait past the model's TTFT SLO.

The count bound (`max_num_seqs + max_waiting` sequences per replica) keeps memory bounded but not
latency: at twice the capacity every admitted request waits for the whole queue ahead of it. With
`ttft_slo_ms` set, a replica predicts how long a new request would wait for its first token and
refuses it at once (429 + Retry-After) when that exceeds the SLO.

The prediction has three parts, all measured on this replica:
- the rest of the engine step running now;
- if every running slot is taken, the wait for as many running sequences to finish as are queued
  ahead of it plus its own, at the rate this replica has been starting sequences over the last
  seconds (with every slot busy, each start is a slot some sequence gave back);
- the step(s) that compute its prompt, together with a decode of every running sequence and the
  prompts queued ahead of it, priced by a line fitted to the engine's own steps: seconds = a +
  b x tokens (`LLMEngine.step_log`), scaled by how much slower than the line the slow steps (90th
  percentile) of the window ran. A prompt is not free: on 2 CPU cores a 220-token prompt of a 124M
  model costs about as much as four decode steps of eight sequences, and three such prompts that
  arrive together make one step of ~0.8-1 s.

A newcomer's prompt also makes the step it joins longer for the queued requests ahead of it, so
the door checks the oldest of those too: its wait so far plus the newcomer's predicted wait.

A request that finds the engine idle is always admitted: it gets the best the replica can give,
so refusing it would not make anyone faster (and a slow step, say a cold start, must never close
the door for good: the requests admitted at idle run the steps that replace those samples).

A model is a guess, and the SLO is on the tail. So the replica compares, for each admitted
request, the TTFT it got with the wait it was predicted and scales predictions by the 90th
percentile of that ratio over the window (never below 1: steps are priced at their slow pace
already): a replica that keeps under-predicting refuses earlier.

And the SLO is a promise: an admitted request still queued in the engine is judged again while it
waits (`late`, every few milliseconds). Once the time it has waited plus what it still needs (by
the same model, from its place in the engine's queue, and at least one slow engine step for its
own prefill) passes the SLO, the replica gives it up and answers 429 with Retry-After, before any
token or stream header was sent, rather than a first token it knows will be late. A request
already scheduled is never given up, nor one that a free slot takes with the next step (its first
token is a step or two away whatever happens; dropping it would only waste the work).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterable
from typing import NamedTuple

WINDOW_S = 10.0
"""First tokens and engine steps older than this do not count."""
MIN_EVENTS = 4
"""Fewer first tokens than this in the window: no rate yet (waits beyond free slots unknown)."""
MIN_PREDICTED_S = 0.05
"""Predicted waits shorter than this are about one engine step: their error ratio is noise, not kept."""
CORRECTION_QUANTILE = 0.9
CORRECTION_RANGE = (1.0, 4.0)
"""Bounds of the correction factor: a few wild ratios must not close the door entirely, and it never
goes below 1 (steps are already priced at their slow pace; a quiet spell of over-predictions must
not admit, when the load comes, a request predicted past the SLO)."""
STEP_QUANTILE = 0.9
"""The step a waiting request still needs is priced at this quantile of recent steps (prefill
steps are the long ones, and a request's first token comes from one)."""
STEP_TAIL_RANGE = (1.0, 3.0)
"""Bounds of the slow-step factor (a step is never priced below the line, nor at a stall)."""
MIN_TOKEN_SPREAD = 2.0
"""Steps in the window must span at least this ratio of tokens (largest / smallest) before the
per-token cost is fitted again; until then the last fitted one is kept (decode-only steps say
nothing about what a prompt costs)."""


class EngineView(NamedTuple):
    """What a replica sees of its engine at one moment."""

    running: int
    """Sequences in the running batch."""
    waiting: int
    """Sequences queued for a slot (the engine's queue and the adds it has not taken yet)."""
    tokens_ahead: int = 0
    """Prompt tokens of those queued sequences (each is a prefill that comes before a newcomer's)."""
    in_flight: tuple[float, int] | None = None
    """(start on the admission's clock, tokens) of the engine step running now."""
    queued_for_s: float = 0.0
    """How long the oldest of the queued sequences has waited (a newcomer's prompt makes its step longer)."""

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.in_flight is None


class TtftAdmission:
    """Predicted wait for a first token, from the engine's queue, its start rate and step times."""

    def __init__(self, slo_s: float | None, max_running: int, token_budget: int = 1024, clock=time.monotonic):
        self.slo_s = slo_s
        self.max_running = max_running
        self.token_budget = token_budget
        """The engine's max_num_batched_tokens: prompts past it take more steps."""
        self.clock = clock
        self.first_tokens: collections.deque[float] = collections.deque(maxlen=512)
        self.ratios: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        """(time, measured TTFT / predicted wait) of recently started (or given-up) requests."""
        self.steps: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=256)
        """(end, tokens, seconds) of the engine's recent steps."""
        self._per_token: float | None = None
        """Last fitted seconds per token (kept while the window holds no steps of varied size)."""

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

    def observe_steps(self, log: Iterable[tuple[float, int, float]]) -> None:
        """Take the engine's step log ((end, tokens, seconds), oldest first); steps seen before are skipped."""
        last = self.steps[-1][0] if self.steps else -math.inf
        for end, tokens, seconds in log:
            if end > last:
                self.steps.append((end, tokens, seconds))

    def _window_steps(self) -> collections.deque[tuple[float, int, float]]:
        now = self.clock()
        while self.steps and now - self.steps[0][0] > WINDOW_S:
            self.steps.popleft()
        return self.steps

    def step_s(self, quantile: float = 0.5) -> float:
        """Engine step time at `quantile` over the window (0.0 when no step was seen in it)."""
        steps = self._window_steps()
        if not steps:
            return 0.0
        r = sorted(s for _, _, s in steps)
        return r[min(len(r) - 1, int(quantile * len(r)))]

    def step_cost(self) -> tuple[float, float]:
        """(a, b): a step of k tokens takes a + b*k seconds, least squares over the window's steps."""
        steps = self._window_steps()
        if not steps:
            return 0.0, self._per_token or 0.0
        n = len(steps)
        mean_k = sum(k for _, k, _ in steps) / n
        mean_s = sum(s for _, _, s in steps) / n
        lo, hi = min(k for _, k, _ in steps), max(k for _, k, _ in steps)
        if n >= 3 and hi >= MIN_TOKEN_SPREAD * lo:
            var = sum((k - mean_k) ** 2 for _, k, _ in steps)
            cov = sum((k - mean_k) * (s - mean_s) for _, k, s in steps)
            self._per_token = max(0.0, cov / var)
        b = self._per_token or 0.0
        return max(0.0, mean_s - b * mean_k), b

    def step_tail(self, fit: tuple[float, float] | None = None) -> float:
        """How much slower than the fitted line (`fit`: step_cost(), computed when None) a slow step is:
        the STEP_QUANTILE of measured / fitted over the window's steps (1.0 with too few), within
        STEP_TAIL_RANGE."""
        a, b = fit if fit is not None else self.step_cost()
        steps = self._window_steps()
        if len(steps) < MIN_EVENTS:
            return 1.0
        r = sorted(s / max(a + b * k, 1e-6) for _, k, s in steps)
        q = r[min(len(r) - 1, int(STEP_QUANTILE * len(r)))]
        return min(STEP_TAIL_RANGE[1], max(STEP_TAIL_RANGE[0], q))

    def tokens_s(self, tokens: int) -> float:
        """Seconds of the steps that compute `tokens` (split into steps of the engine's token budget),
        priced at a slow step's pace (`step_tail`): the SLO is on the tail."""
        if tokens <= 0:
            return 0.0
        a, b = self.step_cost()
        return (math.ceil(tokens / self.token_budget) * a + b * tokens) * self.step_tail((a, b))

    # predictions
    def _beyond_free(self, ahead: int, num_seqs: int, running: int) -> float | None:
        """Seconds until running sequences free a slot for each of `ahead` queued sequences and
        `num_seqs` more (0: there are free slots for all; None: no start rate measured yet)."""
        excess = ahead + num_seqs - max(0, self.max_running - running)
        if excess <= 0:
            return 0.0
        r = self.rate()
        return None if r is None else excess / r

    def _rest_of_step(self, view: EngineView) -> float:
        if view.in_flight is None:
            return 0.0
        started, tokens = view.in_flight
        return max(0.0, self.tokens_s(tokens) - (self.clock() - started))

    def predicted_wait_s(self, num_seqs: int, tokens: int, view: EngineView) -> float:
        """Seconds a new request of `num_seqs` sequences and `tokens` prompt tokens (all its sequences)
        would wait for its first token, before the correction."""
        wait = self._beyond_free(view.waiting, num_seqs, view.running)
        if wait == 0.0:  # it joins the next step(s), with a decode of every running sequence and the prompts ahead
            return self._rest_of_step(view) + self.tokens_s(view.running + view.tokens_ahead + tokens)
        # a slot first, then its prefill beside the decodes of the other running sequences
        return self._rest_of_step(view) + (wait or 0.0) + self.tokens_s(self.max_running - num_seqs + tokens)

    def admits(self, num_seqs: int, tokens: int, view: EngineView) -> bool:
        if self.slo_s is None:
            return True
        if view.idle:  # the best this replica can give, whatever the steps it timed say
            return True
        if self._beyond_free(view.waiting, num_seqs, view.running) is None:
            return True  # queued past the free slots with no rate yet: `late` judges it while it waits
        # the queued requests ahead share the step that computes its prompt: the oldest of them
        # must still make the SLO too
        return view.queued_for_s + self.predicted_wait_s(num_seqs, tokens, view) * self.correction() <= self.slo_s

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
