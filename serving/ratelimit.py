"""Per-key rate limits at the gateway: requests per second (a token bucket) and concurrent
generation requests (streams included) per API key, or per client address when no keys are set.
Past either limit the request is answered 429 with Retry-After before it reaches a model.

Limits hold per gateway replica (server.gateway_replicas > 1 multiplies them): they protect the
service from one client, they are not billing quotas.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class KeyLimiter:
    rps: float | None
    """Sustained requests per second per key; None: no rate limit."""
    burst: int
    """Bucket size: requests a key may send at once after being idle."""
    max_concurrent: int | None
    """Generation requests of one key in flight at once; None: no limit."""
    max_keys: int = 100_000
    """Buckets kept; the least recently seen keys are dropped past it (memory stays bounded)."""
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    _inflight: dict[str, int] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.rps is not None or self.max_concurrent is not None

    def acquire(self, key: str, now: float | None = None) -> tuple[str, int] | None:
        """None when admitted (call `release` when the request ends); otherwise (reason, retry_after_s)."""
        if self.max_concurrent is not None and self._inflight.get(key, 0) >= self.max_concurrent:
            return f"more than {self.max_concurrent} concurrent requests for this key", 1
        if self.rps is not None:
            now = time.monotonic() if now is None else now
            tokens, last = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rps)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                return f"more than {self.rps:g} requests per second for this key", max(
                    1, math.ceil((1.0 - tokens) / self.rps))
            self._buckets[key] = (tokens - 1.0, now)  # re-inserted last: dict order is recency
            if len(self._buckets) > self.max_keys:
                del self._buckets[next(iter(self._buckets))]
        self._inflight[key] = self._inflight.get(key, 0) + 1
        return None

    def release(self, key: str) -> None:
        n = self._inflight.get(key, 0) - 1
        if n > 0:
            self._inflight[key] = n
        else:
            self._inflight.pop(key, None)
