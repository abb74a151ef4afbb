"""How a served replica streams a request's tokens, as the tuner models it (serving.model_core).

With stream_interval_ms 0 (the tuner's deployments leave it so), a replica sends a request's first
token at once, then a chunk of the tokens that waited at the first token at least
stream_interval_s(active requests) after the last chunk; the final chunk goes when the request
ends. Mirrored, not imported: the tuner must not import serving.
"""

from __future__ import annotations

import numpy as np

STREAM_CHUNKS_PER_S = 400.0
STREAM_INTERVAL_BOUNDS_S = (0.02, 0.25)
"""serving.model_core's ADAPTIVE_CHUNK_RATE and MIN_ / MAX_ADAPTIVE_INTERVAL_S: the least time
between two chunks of one request is (requests active in the replica) / STREAM_CHUNKS_PER_S,
within these bounds."""


def stream_interval_s(active: int) -> float:
    """Least seconds between two streamed chunks of one request with `active` requests in the replica."""
    lo, hi = STREAM_INTERVAL_BOUNDS_S
    return min(hi, max(lo, active / STREAM_CHUNKS_PER_S))


def stream_intervals_s(active: np.ndarray) -> np.ndarray:
    """stream_interval_s of each count in `active` (the same floats, in one array operation)."""
    lo, hi = STREAM_INTERVAL_BOUNDS_S
    return np.minimum(hi, np.maximum(lo, active / STREAM_CHUNKS_PER_S))
