"""Open-loop arrival schedules: when each request is due, in seconds from the start of the run.

The whole schedule is computed before the first send, so a slow server can never delay a send
(no coordinated omission): the runner only sleeps until each due time. Inter-arrival times follow
vLLM's benchmark: gamma with shape `burstiness` and mean 1/rate (burstiness 1 = Poisson).
"""

from __future__ import annotations

import math

import numpy as np

_CHUNK = 4096  # intervals drawn per batch when only a duration bounds the schedule


def _intervals(kind: str, rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n inter-arrival times in seconds, mean 1/rate."""
    if kind == "constant":
        return np.full(n, 1.0 / rate)
    shape = 1.0 if kind == "poisson" else burstiness
    # Gamma(k, theta) has mean k*theta; theta = 1/(rate*k) keeps the mean at 1/rate for any k, and
    # the coefficient of variation is 1/sqrt(k): k < 1 burstier than Poisson, k > 1 smoother.
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def schedule(
    kind: str,
    rate: float,
    burstiness: float = 1.0,
    count: int | None = None,
    duration: float | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Due times (s, float64, non-decreasing, first at 0) of up to `count` requests, all before
    `duration` when it is given. rate = inf puts every request at 0 (count must be given)."""
    if count is None and duration is None:
        raise ValueError("schedule needs a count or a duration")
    if math.isinf(rate):
        if count is None:
            raise ValueError("an infinite rate needs a request count")
        return np.zeros(count)
    rng = np.random.default_rng(seed)
    if count is not None:
        gaps = _intervals(kind, rate, burstiness, max(count - 1, 0), rng)
        times = np.concatenate([[0.0], np.cumsum(gaps)])[:count]
    else:
        parts, last = [np.zeros(1)], 0.0
        while last < duration:
            part = last + np.cumsum(_intervals(kind, rate, burstiness, _CHUNK, rng))
            parts.append(part)
            last = float(part[-1])
        times = np.concatenate(parts)
    if duration is not None:
        times = times[times < duration]
    return times


def rate_of(times: np.ndarray | list[float]) -> float | None:
    """Requests/s over a list of send times: (n - 1) / (last - first); None when undefined."""
    if len(times) < 2:
        return None
    span = float(np.max(times) - np.min(times))
    return (len(times) - 1) / span if span > 0 else math.inf
