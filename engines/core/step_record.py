"""What the engine did in each working step, kept for the tuner's served-step fit.

The engine is given a `StepRecorder` (by default one sized by EngineConfig.step_record_len) and
records every step that computed tokens; `GET /v1/admin/steps` (serving/steps_api.py) reads a
replica's window and `shardserve tune profile` fits the served step time on it. Pure Python: the
recorder holds tuples, which pickle several times faster than dicts when a replica publishes a
window of thousands of steps.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.core.plan import StepPlan

STEP_FIELDS = ("end_s", "seconds", "gap_s", "decode_seqs", "decode_context_tokens", "prefill_seqs",
               "prefill_tokens", "prefill_attention_pairs", "sampled")
"""One recorded step, in tuple order: end_s on time.monotonic(); seconds of the step; gap_s the seconds
since the previous step ended when that step left requests unfinished (the loop's own time between
steps: outputs, inbox), else -1 (the engine may have idled); decode sequences and the KV positions
their tokens attend to; prefill sequences, tokens and attention pairs (query x key positions of the
chunks); sequences sampled."""
STEP_RECORD_MAX = 1_000_000
"""The most steps a recorder may keep (EngineConfig.step_record_len's ceiling)."""


def step_shape(plan: StepPlan) -> tuple[int, int, int, int, int, int]:
    """(decode sequences, decode context tokens, prefill sequences, prefill tokens, prefill
    attention pairs, sampled) of a plan: a query at position p attends to p + 1 keys."""
    ctx = sum(w.start_pos + 1 for w in plan.decode)
    ptok = pairs = 0
    for w in plan.prefill:
        s, e = w.start_pos, w.start_pos + len(w.token_ids)
        ptok += e - s
        pairs += (e * (e + 1) - s * (s + 1)) // 2
    sampled = sum(1 for w in (*plan.decode, *plan.prefill) if w.sample)
    return len(plan.decode), ctx, len(plan.prefill), ptok, pairs, sampled


class StepRecorder:
    """The latest `capacity` working steps as tuples in STEP_FIELDS order.

    Written by the engine's thread; other threads read with `rows()` (a copy)."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= STEP_RECORD_MAX:
            raise ValueError(f"step_record_len: must be an integer in [1, {STEP_RECORD_MAX}], got {capacity!r}")
        self.capacity = capacity
        self._rows: collections.deque[tuple] = collections.deque(maxlen=capacity)

    def record(self, end: float, seconds: float, gap: float, plan: StepPlan) -> None:
        """One step that computed tokens: its end (monotonic), wall seconds, the gap before it (-1:
        the engine may have idled) and the shape of its plan."""
        self._rows.append((end, seconds, gap, *step_shape(plan)))

    def rows(self) -> tuple[tuple, ...]:
        """The kept steps, oldest first."""
        return tuple(self._rows)

    def __len__(self) -> int:
        return len(self._rows)
