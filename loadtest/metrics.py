"""Per-request records and the aggregate summary. Definitions follow vLLM's benchmark_serving:

- TTFT: send -> first streamed chunk that carries output.
- E2EL: send -> last streamed chunk that carries output.
- TPOT (per request): (E2EL - TTFT) / (output_tokens - 1), for requests with > 1 output token.
- ITL: every gap between successive output chunks, pooled over all requests. A chunk that carries
  several tokens gives one gap, as in vLLM (TPOT is the per-token view).
- Goodput: measured requests that succeeded and meet every SLO's per-request bound, per second.

Records keep seconds; the summary reports milliseconds (`_ms`) as vLLM prints them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from loadtest.arrivals import rate_of
from loadtest.config import SLO

PERCENTILES = (50, 90, 95, 99)
LAG_WARN_MS = 10.0  # p99 send lag above which the generator, not the server, may be the limit


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; `scheduled_s`, `sent_s` and `done_s` are
    relative to the run start, the others are durations."""

    index: int
    warmup: bool
    scheduled_s: float  # due time in the schedule (closed loop: when a worker became free)
    input_tokens: int = 0
    requested_output_tokens: int = 0  # max_tokens sent
    sent_s: float = math.nan  # just before the HTTP request was issued
    done_s: float = math.nan  # last byte, or the failure
    ttft_s: float = math.nan
    e2el_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = ""  # usage | tokenizer | chunks
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and not math.isnan(self.ttft_s)

    @property
    def tpot_s(self) -> float:
        """(E2EL - TTFT) / (output_tokens - 1); 0 for a single-token reply (as vLLM's goodput)."""
        if not self.ok:
            return math.nan
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> None:
        self.error_kind, self.error = kind, message[:500]

    def to_json(self) -> dict:
        """One JSONL row, in milliseconds."""
        ms = 1000.0
        row = {
            "index": self.index,
            "warmup": self.warmup,
            "scheduled_ms": self.scheduled_s * ms,
            "sent_ms": self.sent_s * ms,
            "send_lag_ms": (self.sent_s - self.scheduled_s) * ms,
            "done_ms": self.done_s * ms,
            "ttft_ms": self.ttft_s * ms,
            "tpot_ms": self.tpot_s * ms,
            "e2el_ms": self.e2el_s * ms,
            "itl_ms": [g * ms for g in self.itl_s],
            "input_tokens": self.input_tokens,
            "requested_output_tokens": self.requested_output_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "error_kind": self.error_kind,
            "error": self.error,
        }
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


@dataclass(frozen=True)
class Stats:
    """mean and percentiles of one metric, in ms; NaN when there are no values."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_s: list[float] | np.ndarray) -> Stats:
        a = np.asarray(values_s, dtype=float) * 1000.0
        if a.size == 0:
            return cls(0, *([math.nan] * 6))
        p = np.percentile(a, PERCENTILES)  # linear interpolation, as vLLM (numpy's default)
        return cls(int(a.size), float(a.mean()), *map(float, p), float(a.max()))


@dataclass(frozen=True)
class SloResult:
    key: str  # e.g. ttft_p99_ms
    threshold_ms: float
    observed_ms: float  # the run-level statistic, failures counted as infinitely slow
    ok: bool


@dataclass(frozen=True)
class Summary:
    """Aggregates over the measured (non-warm-up) requests."""

    requests: int  # measured requests sent
    completed: int  # of which succeeded
    failed: int
    warmup_requests: int
    duration_s: float  # first measured send -> last measured completion
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    send_lag_ms: Stats  # actual - scheduled send time
    scheduled_rate: float | None  # requests/s of the schedule (None for a closed loop)
    achieved_rate: float | None  # requests/s of the actual sends
    max_in_flight: int
    errors: dict[str, int]
    good_requests: int | None  # None without SLOs
    goodput: float | None  # good requests / s
    slo_results: tuple[SloResult, ...]
    meets_slo: bool | None  # None without SLOs
    prompt_lengths: str  # exact | approximate
    output_tokens_source: dict[str, int]
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return json_safe(asdict(self))

    def flat(self) -> dict:
        """One level of keys (ttft_ms_p99, ...) for CSV rows and tables."""
        out = {}
        for k, v in self.to_json().items():
            if isinstance(v, dict) and k not in ("errors", "output_tokens_source"):
                out.update({f"{k}_{sk}": sv for sk, sv in v.items() if sk != "count"})
            elif k == "slo_results":
                out.update({f"slo_{r['key']}": r["observed_ms"] for r in v})
            elif isinstance(v, (dict, list, tuple)):
                out[k] = ";".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else ";".join(v)
            else:
                out[k] = v
        return out


def json_safe(obj):
    """NaN/inf to None so the JSON is standard."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def slo_value_s(record: RequestRecord, metric: str) -> float:
    """The request's value of an SLO metric in seconds; a failure counts as infinitely slow."""
    if not record.ok:
        return math.inf
    return {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2el_s}[metric]


def percentile_with_inf(sorted_values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, but exact when some values are +inf."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = q / 100.0 * (n - 1)
    lo = math.floor(pos)
    frac = pos - lo
    if frac == 0.0:
        return sorted_values[lo]
    a, b = sorted_values[lo], sorted_values[lo + 1]
    return math.inf if math.isinf(b) else a + (b - a) * frac


def evaluate_slo(records: list[RequestRecord], slo: SLO) -> SloResult:
    values = sorted(slo_value_s(r, slo.metric) * 1000.0 for r in records)
    if slo.stat == "mean":
        observed = sum(values) / len(values) if values else math.nan
    else:
        observed = percentile_with_inf(values, float(slo.stat[1:]))
    return SloResult(slo.key, slo.threshold_ms, observed, bool(observed <= slo.threshold_ms))


def is_good(record: RequestRecord, slos: tuple[SLO, ...]) -> bool:
    """Succeeded and within every SLO's per-request bound."""
    return record.ok and all(slo_value_s(record, s.metric) * 1000.0 <= s.threshold_ms for s in slos)


def summarize(
    records: list[RequestRecord],
    slos: tuple[SLO, ...] = (),
    *,
    open_loop: bool = True,
    prompt_lengths: str = "approximate",
    max_in_flight: int = 0,
) -> Summary:
    """Aggregate the measured records (warm-up records are counted, then ignored)."""
    warm = sum(r.warmup for r in records)
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    sent = [r.sent_s for r in measured if not math.isnan(r.sent_s)]
    done = [r.done_s for r in measured if not math.isnan(r.done_s)]
    duration = (max(done) - min(sent)) if sent and done else math.nan
    out_tokens = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration and duration > 0 else math.nan

    good = sum(is_good(r, slos) for r in measured) if slos else None
    slo_results = tuple(evaluate_slo(measured, s) for s in slos)
    warnings = []
    lag = Stats.of([r.sent_s - r.scheduled_s for r in measured if not math.isnan(r.sent_s)])
    if open_loop and lag.p99 > LAG_WARN_MS:
        warnings.append(
            f"p99 send lag {lag.p99:.1f} ms > {LAG_WARN_MS:g} ms: sends fell behind the schedule "
            "(a concurrency cap, or the generator is overloaded); latencies start at the actual send"
        )
    return Summary(
        requests=len(measured),
        completed=len(ok),
        failed=len(measured) - len(ok),
        warmup_requests=warm,
        duration_s=duration,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(out_tokens),
        total_input_tokens=sum(r.input_tokens for r in ok),
        total_output_tokens=out_tokens,
        ttft_ms=Stats.of([r.ttft_s for r in ok]),
        tpot_ms=Stats.of([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl_ms=Stats.of([g for r in ok for g in r.itl_s]),
        e2el_ms=Stats.of([r.e2el_s for r in ok]),
        send_lag_ms=lag,
        scheduled_rate=rate_of([r.scheduled_s for r in measured]) if open_loop else None,
        achieved_rate=rate_of(sent),
        max_in_flight=max_in_flight,
        errors=dict(Counter(r.error_kind for r in measured if not r.ok and r.error_kind)),
        good_requests=good,
        goodput=per_s(good) if slos else None,
        slo_results=slo_results,
        meets_slo=all(s.ok for s in slo_results) if slos else None,
        prompt_lengths=prompt_lengths,
        output_tokens_source=dict(Counter(r.output_tokens_source for r in ok)),
        warnings=tuple(warnings),
    )
