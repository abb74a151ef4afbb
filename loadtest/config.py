"""Load-test configuration: frozen, validated dataclasses and parsers for their CLI spellings.

One source of truth for every default: the CLI (`loadtest.cli`) and the tuner both build a
`LoadTestConfig`; nothing mutates it afterwards, and derived values come from the pure functions
at the bottom of this file. Validation errors name the field, its CLI flag and the allowed values.
This module imports nothing heavy (no numpy, no aiohttp) so `shardserve --help` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from loadtest.errors import ConfigError

BACKENDS = ("openai-completions", "openai-chat", "kserve-generate-stream")
ARRIVALS = ("constant", "poisson", "gamma")
DIST_KINDS = ("fixed", "uniform", "normal")
SLO_METRICS = ("ttft", "tpot", "e2el")  # per-request metrics, as vLLM's --goodput
SLO_STATS = ("mean", "p50", "p90", "p95", "p99")
DEFAULT_SLO_STAT = "p99"  # the run-level check for a bare key such as `tpot_ms=50`
DEFAULT_NUM_PROMPTS = 1000  # vLLM's default, used when neither a count nor a duration is given
CLOSED_LOOP_POOL = 1000  # prompts prepared for a closed-loop run bounded only by duration
MAX_LENGTH = 10**7  # tokens: no model's context comes near it; a larger length is a typo, and an
# unbounded one overflows numpy's int64 samplers or builds a prompt that exhausts memory


def _flag(name: str) -> str:
    return "--" + {"slos": "slo"}.get(name, name).replace("_", "-")


def _fail(name: str, message: str) -> ConfigError:
    return ConfigError(f"{name} ({_flag(name)}): {message}")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution. `fixed`: always `value`; `uniform`: integers in [low, high];
    `normal`: N(value, std) truncated to [low, high] by resampling (not clipping, so the bounds
    do not pile up probability)."""

    kind: str = "fixed"
    value: int = 128  # fixed length, or the mean of `normal` (tokens)
    std: float = 0.0  # tokens; normal only
    low: int = 1  # tokens, inclusive
    high: int = 0  # tokens, inclusive; 0 = unbounded (fixed) or value + 4 std (normal)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.value}"
        if self.kind == "uniform":
            return f"uniform:{self.low}:{self.high}"
        return f"normal:{self.value}:{self.std:g}:{self.low}:{self.high}"


@dataclass(frozen=True)
class LengthPair:
    """One component of a weighted mix of (input, output) lengths."""

    input_len: int
    output_len: int
    weight: float = 1.0


@dataclass(frozen=True)
class SLO:
    """One service-level objective. Each request is checked against `threshold_ms` on `metric`
    (goodput counts requests meeting every SLO); the run meets it when `stat` of the metric over
    all measured requests (failures counted as infinitely slow) is <= `threshold_ms`."""

    metric: str  # ttft | tpot | e2el
    threshold_ms: float
    stat: str = DEFAULT_SLO_STAT

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}_ms"


@dataclass(frozen=True)
class LoadTestConfig:
    """Everything one load-test run needs. Times are in seconds unless a name says `_ms`."""

    url: str
    """Server base URL (http://host:port) or the full endpoint URL."""
    model: str
    """Model name sent in each request (KServe: the model in the URL path)."""
    backend: str = "openai-completions"
    """Protocol: openai-completions | openai-chat | kserve-generate-stream."""
    request_rate: float = math.inf
    """Mean requests/s of the open-loop schedule; inf sends everything at t=0."""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival times (1 = Poisson, <1 burstier, >1 smoother)."""
    arrival: str = "gamma"
    """Inter-arrival process: constant | poisson | gamma. The default, gamma with burstiness 1, is
    Poisson, as in vLLM, so `--burstiness` alone works as it does there."""
    max_concurrency: int | None = None
    """Cap on requests in flight; later sends wait (their wait shows as send lag)."""
    closed_loop_concurrency: int | None = None
    """Closed loop instead of open loop: this many workers, each sends when its last finished."""
    num_prompts: int | None = None
    """Measured requests; default 1000 unless `duration` is given."""
    duration: float | None = None
    """Stop scheduling new requests after this many seconds (warm-up included)."""
    warmup: int = 0
    """Requests sent first, on the same schedule, and excluded from statistics."""
    random_input_len: int = 1024
    """Prompt length (tokens) for input_dist=fixed."""
    random_output_len: int = 128
    """max_tokens for output_dist=fixed."""
    input_dist: LengthDist | None = None
    """Prompt length distribution; None = fixed at random_input_len."""
    output_dist: LengthDist | None = None
    """Output length distribution; None = fixed at random_output_len."""
    length_mix: tuple[LengthPair, ...] = ()
    """Weighted (input, output) pairs; replaces input_dist/output_dist."""
    dataset: Path | None = None
    """JSONL prompt file (`prompt` or `messages`, optional `output_len`)."""
    trace: Path | None = None
    """JSONL trace (`timestamp` s or `timestamp_ms`, `input_length`, `output_length`)."""
    time_scale: float = 1.0
    """Multiplies trace inter-arrival times: 0.5 replays twice as fast."""
    tokenizer: Path | None = None
    """tokenizer.json: exact prompt lengths and output-token counts; else approximate."""
    ignore_eos: bool = False
    """Send ignore_eos and min_tokens=max_tokens so outputs are exactly max_tokens long."""
    include_usage: bool = True
    """Ask OpenAI servers for usage in the stream (exact output-token counts)."""
    slos: tuple[SLO, ...] = ()
    """Service-level objectives for goodput, pass/fail and sweeps."""
    seed: int = 0
    """Seeds prompts, lengths and arrival times."""
    content_seed: int | None = None
    """Seeds the synthetic prompts' words alone (lengths and arrivals still follow `seed`): the same workload
    again with other words, so a server's prefix cache cannot serve a repetition. None: `seed`."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <key>`."""
    timeout: float = 600.0
    """Per-request limit (s), from send to the last byte."""
    preflight: bool = True
    """Send one short request first, to turn a wrong URL or non-streaming server into one clear error."""
    progress: bool = True
    """Show a live progress bar."""
    result_dir: Path | None = None
    """Where to write requests.jsonl, summary.json/.csv and plots (the CLI writes; run() does not)."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class SweepConfig:
    """Search for the highest request rate whose run meets every SLO: double from `start_rate`
    until a step fails (halve while it fails), then bisect until hi/lo - 1 <= `tolerance`."""

    start_rate: float = 1.0  # requests/s
    max_rate: float = 10_000.0  # requests/s; the doubling stops here
    min_rate: float = 0.01  # requests/s; the halving stops here (the SLO is unreachable)
    tolerance: float = 0.05  # relative gap between the last pass and first fail
    max_steps: int = 30
    early_stop: bool = True  # end a step as soon as its SLO can no longer be met
    min_step_s: float = 0.0
    """Seconds each step offers its rate for at least: a step bounded by a request count sends
    max(count, ceil(rate x min_step_s)) requests, one bounded by a duration lasts at least this long.
    A few requests at a high rate are a burst, which a server far below that rate absorbs within a
    loose latency SLO: with a fixed count the sweep would call any rate up to max_rate sustainable.
    0: each step as the run's config bounds it."""

    def __post_init__(self) -> None:
        if not (0 < self.min_rate <= self.start_rate <= self.max_rate < math.inf):
            raise ConfigError(
                "sweep rates: need 0 < min_rate <= start_rate (--sweep-start-rate) <= max_rate "
                f"(--sweep-max-rate) < inf, got {self.min_rate}, {self.start_rate}, {self.max_rate}"
            )
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"sweep tolerance (--sweep-tolerance) must be in (0, 1), got {self.tolerance}")
        if self.max_steps < 1:
            raise ConfigError(f"sweep max_steps must be >= 1, got {self.max_steps}")
        if not (self.min_step_s >= 0 and math.isfinite(self.min_step_s)):
            raise ConfigError(f"sweep min_step_s (--sweep-min-step-s) must be a finite number of seconds >= 0, "
                              f"got {self.min_step_s}")


# --- validation ---------------------------------------------------------------------------------


def _validate(c: LoadTestConfig) -> None:
    if not c.url.startswith(("http://", "https://")):
        raise _fail("url", f"must start with http:// or https://, got {c.url!r}")
    if not c.model:
        raise _fail("model", "must be a non-empty model name")
    if c.backend not in BACKENDS:
        raise _fail("backend", f"must be one of {', '.join(BACKENDS)}; got {c.backend!r}")
    if c.arrival not in ARRIVALS:
        raise _fail("arrival", f"must be one of {', '.join(ARRIVALS)}; got {c.arrival!r}")
    if math.isnan(c.request_rate) or c.request_rate <= 0:
        raise _fail(
            "request_rate", f"must be > 0 requests/s, or inf to send all at once; got {c.request_rate}"
        )
    if not (c.burstiness > 0 and math.isfinite(c.burstiness)):
        raise _fail("burstiness", f"must be a finite number > 0 (1 = Poisson); got {c.burstiness}")
    if c.arrival != "gamma" and c.burstiness != 1.0:
        raise _fail("burstiness", f"applies to --arrival gamma only; got --arrival {c.arrival}")
    for name in ("max_concurrency", "closed_loop_concurrency", "num_prompts"):
        value = getattr(c, name)
        if value is not None and value < 1:
            raise _fail(name, f"must be an integer >= 1, got {value}")
    if c.duration is not None and not (c.duration > 0 and math.isfinite(c.duration)):
        raise _fail("duration", f"must be a finite number of seconds > 0, got {c.duration}")
    if c.warmup < 0:
        raise _fail("warmup", f"must be >= 0 requests, got {c.warmup}")
    for name in ("random_input_len", "random_output_len"):
        if not 1 <= getattr(c, name) <= MAX_LENGTH:
            raise _fail(name, f"must be 1 to {MAX_LENGTH} tokens, got {getattr(c, name)}")
    if not (c.timeout > 0 and math.isfinite(c.timeout)):
        raise _fail("timeout", f"must be a finite number of seconds > 0, got {c.timeout}")
    if not (c.time_scale > 0 and math.isfinite(c.time_scale)):
        raise _fail("time_scale", f"must be a finite number > 0, got {c.time_scale}")
    for name in ("input_dist", "output_dist"):
        dist = getattr(c, name)
        if dist is not None:
            _validate_dist(name, dist)
    if c.length_mix:
        if c.input_dist is not None or c.output_dist is not None:
            raise _fail("length_mix", "replaces --input-dist/--output-dist; give one or the other")
        for pair in c.length_mix:
            _validate_pair(pair)
    if c.closed_loop_concurrency is not None:
        if c.max_concurrency is not None:
            raise _fail("max_concurrency", "does not apply to a closed loop (--closed-loop-concurrency)")
        if c.trace is not None:
            raise _fail("trace", "replays its own timestamps; it cannot run as a closed loop")
    if c.dataset is not None and c.trace is not None:
        raise _fail("dataset", "give either --dataset or --trace, not both")
    _refuse_ignored(c)
    for name in ("dataset", "trace", "tokenizer"):
        path = getattr(c, name)
        if path is not None and not Path(path).is_file():
            raise _fail(name, f"file not found: {path}")
    seen = set()
    for slo in c.slos:
        if slo.metric in seen:
            raise _fail("slos", f"{slo.metric} is given twice")
        seen.add(slo.metric)


def _refuse_ignored(c: LoadTestConfig) -> None:
    """An option the workload source would silently ignore is refused, so a run never measures
    something other than what was asked. Only values that differ from the field's default count as
    given: a default cannot be told from an explicit flag equal to it, and that one changes nothing."""
    defaults = LoadTestConfig.__dataclass_fields__
    if c.trace is not None:  # the trace gives every request's time and both lengths
        # (--random-input-len/--random-output-len are left alone: a shared base config of a script
        # or the tests sets them for every source)
        for name in ("request_rate", "arrival", "burstiness", "input_dist", "output_dist", "length_mix"):
            if getattr(c, name) != defaults[name].default:
                raise _fail(name, "does not apply to --trace, which gives each request's time and lengths "
                                  "(use --time-scale to replay faster)")
    elif c.time_scale != defaults["time_scale"].default:
        raise _fail("time_scale", "applies to --trace only")
    if c.dataset is not None and c.input_dist is not None:  # the file's prompts set the input lengths
        raise _fail("input_dist", "does not apply to --dataset, whose prompts set the input lengths")


def _validate_pair(pair: LengthPair) -> None:
    lengths_ok = all(1 <= n <= MAX_LENGTH for n in (pair.input_len, pair.output_len))
    if not (lengths_ok and pair.weight > 0 and math.isfinite(pair.weight)):
        raise _fail("length_mix", f"needs lengths of 1 to {MAX_LENGTH} tokens and a finite weight > 0, "
                                  f"got {pair.input_len}:{pair.output_len}:{pair.weight:g}")


def _validate_dist(name: str, d: LengthDist) -> None:
    if d.kind not in DIST_KINDS:
        raise _fail(name, f"kind must be one of {', '.join(DIST_KINDS)}; got {d.kind!r}")
    # the samplers draw int64 lengths and the prompt builder makes that many words: bound them here
    if not all(n <= MAX_LENGTH for n in (d.value, d.low, d.high)):
        raise _fail(name, f"lengths must be at most {MAX_LENGTH} tokens, got {d.describe()}")
    if not math.isfinite(d.std):
        raise _fail(name, f"std must be a finite number of tokens, got {d.std}")
    if d.kind == "fixed" and d.value < 1:
        raise _fail(name, f"fixed length must be >= 1 token, got {d.value}")
    if d.kind == "uniform" and not 1 <= d.low <= d.high:
        raise _fail(name, f"uniform needs 1 <= low <= high, got low={d.low} high={d.high}")
    if d.kind == "normal":
        if not (d.std >= 0 and d.value >= 1):
            raise _fail(name, f"normal needs mean >= 1 and std >= 0, got mean={d.value} std={d.std}")
        if not 1 <= d.low <= d.value <= d.high:
            raise _fail(name, f"normal needs 1 <= low <= mean <= high, got {d.low} <= {d.value} <= {d.high}")


# --- parsers for CLI strings --------------------------------------------------------------------


def parse_length_dist(spec: str, default_len: int, name: str) -> LengthDist:
    """Parse `fixed`, `fixed:N`, `uniform:LOW:HIGH`, `normal:MEAN:STD` or `normal:MEAN:STD:LOW:HIGH`."""
    parts = spec.strip().split(":")
    kind = parts[0].lower()
    usage = "use fixed, fixed:N, uniform:LOW:HIGH, normal:MEAN:STD or normal:MEAN:STD:LOW:HIGH"
    if kind not in DIST_KINDS:
        raise _fail(name, f"unknown distribution {parts[0]!r}; {usage}")
    try:
        nums = [float(p) for p in parts[1:]]
    except ValueError:
        raise _fail(name, f"cannot read numbers in {spec!r}; {usage}") from None
    # inf, nan and huge values would crash int() or numpy's samplers: refuse them with the option's name
    if not all(math.isfinite(x) and abs(x) <= MAX_LENGTH for x in nums):
        raise _fail(name, f"numbers must be finite and at most {MAX_LENGTH} tokens, got {spec!r}")
    if kind == "fixed" and len(nums) in (0, 1):
        dist = LengthDist("fixed", value=int(nums[0]) if nums else default_len)
    elif kind == "uniform" and len(nums) == 2:
        dist = LengthDist("uniform", value=int((nums[0] + nums[1]) / 2), low=int(nums[0]), high=int(nums[1]))
    elif kind == "normal" and len(nums) in (2, 4):
        mean, std = int(nums[0]), nums[1]
        # the default upper bound is mean + 4 std, capped where every length is capped
        low, high = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, int(min(mean + 4 * std, MAX_LENGTH)))
        dist = LengthDist("normal", value=mean, std=std, low=low, high=high)
    else:
        raise _fail(name, f"wrong number of fields in {spec!r}; {usage}")
    _validate_dist(name, dist)
    return dist


def parse_length_mix(spec: str) -> tuple[LengthPair, ...]:
    """Parse `IN:OUT:WEIGHT,IN:OUT:WEIGHT,...` (weight optional, default 1)."""
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            pair = LengthPair(int(parts[0]), int(parts[1]), float(parts[2]) if len(parts) == 3 else 1.0)
        except ValueError:
            raise _fail("length_mix", f"cannot read {item!r}; use IN:OUT:WEIGHT,IN:OUT:WEIGHT") from None
        _validate_pair(pair)  # here, not only in LoadTestConfig: inf/nan weights crash numpy's sampler
        pairs.append(pair)
    if not pairs:
        raise _fail("length_mix", "is empty; use IN:OUT:WEIGHT,IN:OUT:WEIGHT")
    return tuple(pairs)


def parse_slo(spec: str) -> SLO:
    """Parse `METRIC_ms=V` or `METRIC_STAT_ms=V` (e.g. `tpot_ms=50`, `ttft_p99_ms=500`), or vLLM's
    `--goodput` spelling `METRIC:V` (`ttft:500`). A bare metric checks the run at p99."""
    sep = "=" if "=" in spec else ":"
    key, _, value = spec.partition(sep)
    key = key.strip().lower().removesuffix("_ms")
    metric, _, stat = key.partition("_")
    stat = stat or DEFAULT_SLO_STAT
    allowed = (
        f"use METRIC_ms=V or METRIC_STAT_ms=V with METRIC in {', '.join(SLO_METRICS)} "
        f"and STAT in {', '.join(SLO_STATS)} (e.g. ttft_p99_ms=500, tpot_ms=50)"
    )
    if metric not in SLO_METRICS or stat not in SLO_STATS:
        raise _fail("slos", f"unknown SLO {spec!r}; {allowed}")
    try:
        threshold = float(value)
    except ValueError:
        raise _fail("slos", f"SLO {spec!r} needs a number of milliseconds; {allowed}") from None
    if not threshold > 0:
        raise _fail("slos", f"SLO {spec!r} must be > 0 ms")
    return SLO(metric, threshold, stat)


# --- derived values (pure functions) ------------------------------------------------------------


def is_closed_loop(c: LoadTestConfig) -> bool:
    return c.closed_loop_concurrency is not None


def measured_count(c: LoadTestConfig) -> int | None:
    """Measured requests by count, or None when only the duration bounds the run."""
    if c.num_prompts is not None:
        return c.num_prompts
    return None if c.duration is not None else DEFAULT_NUM_PROMPTS


def check_runnable(c: LoadTestConfig) -> None:
    """Checks that depend on how the config is used: a sweep overrides request_rate, so a base
    config with a duration and the default infinite rate is fine there but not for one run."""
    bounded_by_duration_only = c.duration is not None and c.num_prompts is None
    if bounded_by_duration_only and math.isinf(c.request_rate) and not is_closed_loop(c) and c.trace is None:
        raise _fail("duration", "needs a finite --request-rate (or --num-prompts, a closed loop or a trace)")


__all__ = [
    "ARRIVALS",
    "BACKENDS",
    "DIST_KINDS",
    "MAX_LENGTH",
    "SLO",
    "LengthDist",
    "LengthPair",
    "LoadTestConfig",
    "SweepConfig",
    "check_runnable",
    "is_closed_loop",
    "measured_count",
    "parse_length_dist",
    "parse_length_mix",
    "parse_slo",
]
