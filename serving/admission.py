"""Admission by time to first token: refuse (429) what would wait past the model's TTFT SLO.

The count bound (`max_num_seqs + max_waiting` sequences per replica) keeps memory bounded but not
latency: at twice the capacity every admitted request waits for the whole queue ahead of it. With
`ttft_slo_ms` set, a replica also predicts how long a new request would wait for its first token
and refuses it at once (429 + Retry-After) when that exceeds the SLO, so the requests it does admit
keep their TTFT. The prediction is Little's law on what the replica measured itself: the sequences
admitted ahead of the request that have no first token yet, divided by the rate at which sequences
got their first token over the last few seconds. Nothing is predicted while the replica has a free
running slot and an empty queue, or before it has seen enough first tokens to know its rate.
"""

from __future__ import annotations

import collections
import time

WINDOW_S = 10.0
"""First tokens older than this do not count towards the rate."""
MIN_EVENTS = 4
"""Fewer first tokens than this in the window: no rate yet, admit on the count bound alone."""


class TtftAdmission:
    """Predicted wait for a first token, from the queue ahead and the measured start rate."""

    def __init__(self, slo_s: float | None, max_running: int, clock=time.monotonic):
        self.slo_s = slo_s
        self.max_running = max_running
        self.clock = clock
        self.queued = 0
        """Sequences admitted that have not produced a first token yet."""
        self.first_tokens: collections.deque[float] = collections.deque(maxlen=512)

    def rate(self) -> float | None:
        """First tokens per second over the window (None: too few to tell)."""
        now = self.clock()
        while self.first_tokens and now - self.first_tokens[0] > WINDOW_S:
            self.first_tokens.popleft()
        if len(self.first_tokens) < MIN_EVENTS:
            return None
        span = max(now - self.first_tokens[0], 1e-3)
        return len(self.first_tokens) / span

    def predicted_wait_s(self, num_seqs: int, running: int) -> float:
        """Seconds a request of `num_seqs` sequences would wait for its first token (0: starts now)."""
        if self.queued == 0 and running + num_seqs <= self.max_running:
            return 0.0
        r = self.rate()
        return 0.0 if r is None else (self.queued + num_seqs) / r

    def admits(self, num_seqs: int, running: int) -> bool:
        return self.slo_s is None or self.predicted_wait_s(num_seqs, running) <= self.slo_s

    # bookkeeping, called by the replica
    def admitted(self, num_seqs: int) -> None:
        self.queued += num_seqs

    def first_token(self, num_seqs: int) -> None:
        """An admitted request of `num_seqs` sequences produced its first token (they start together)."""
        self.queued = max(0, self.queued - num_seqs)
        now = self.clock()
        self.first_tokens.extend([now] * num_seqs)

    def left(self, num_seqs: int) -> None:
        """An admitted request ended (failed, aborted, refused) before its first token."""
        self.queued = max(0, self.queued - num_seqs)
