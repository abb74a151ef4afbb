"""SLO sweeps: the highest request rate at which a run still meets every SLO.

Search: run at `start_rate`; double while runs pass (halve while they fail) to bracket the edge,
then bisect between the highest passing and lowest failing rate until hi/lo - 1 <= tolerance.
The answer is the highest rate that passed. Each step offers its rate for at least
SweepConfig.min_step_s seconds (a step of a fixed request count at a high rate is a burst).

Early stop: an over-saturated server makes latency grow for as long as the step runs. A step ends
as soon as its SLO can no longer be met: with N planned requests, a p-th percentile SLO fails once
more than (N - 1) - floor(p/100 * (N - 1)) requests are known to violate it, counting failures,
finished requests over the bound, and in-flight requests already older than a TTFT or E2EL bound.
That count only grows, so the stop never fails a step that would have passed. After a stopped
step the sweep sends one short request and waits for it, so that (on a FIFO server) the next step
starts only once the backlog the stopped step left behind has drained.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from loadtest.config import SLO, LoadTestConfig, SweepConfig, is_closed_loop
from loadtest.errors import ConfigError
from loadtest.metrics import RequestRecord, Summary, slo_value_s
from loadtest.runner import Report, run_async, run_in_new_loop, wait_until_idle

DEFAULT_STEP_DURATION_S = 60.0  # per step, when the config bounds runs by neither count nor duration


class SloMonitor:
    """Stops a run once one of its percentile SLOs is certain to fail (see the module docstring)."""

    def __init__(self, slos: tuple[SLO, ...]) -> None:
        self.slos = tuple(s for s in slos if s.stat != "mean")  # a mean has no violation budget
        self.budget: dict[str, int] = {}
        self.violations = {s.key: 0 for s in self.slos}

    def on_start(self, planned: int | None) -> None:
        for s in self.slos:
            if not planned or planned < 1:
                self.budget[s.key] = 1 << 62
                continue
            # the percentile interpolates from sorted value number floor(pos) up (as
            # metrics.percentile_with_inf, with the same float expression): it certainly fails
            # once that value violates, i.e. once more than (N - 1) - floor(pos) values do
            pos = float(s.stat[1:]) / 100.0 * (planned - 1)
            self.budget[s.key] = (planned - 1) - math.floor(pos)

    def _over(self, s: SLO, extra: int) -> str | None:
        n = self.violations[s.key] + extra
        if n > self.budget[s.key]:
            return f"{s.key} <= {s.threshold_ms:g} ms can no longer be met ({n} requests over the bound)"
        return None

    def on_complete(self, rec: RequestRecord) -> str | None:
        for s in self.slos:
            if slo_value_s(rec, s.metric) * 1000.0 > s.threshold_ms:
                self.violations[s.key] += 1
                reason = self._over(s, 0)
                if reason:
                    return reason
        return None

    def on_tick(self, in_flight: list[RequestRecord], now_s: float) -> str | None:
        for s in self.slos:
            if s.metric == "tpot":
                continue  # not known until the request ends
            bound = s.threshold_ms / 1000.0
            if s.metric == "ttft":
                late = sum(
                    (r.ttft_s > bound) if not math.isnan(r.ttft_s) else (now_s - r.sent_s > bound)
                    for r in in_flight
                )
            else:
                late = sum(now_s - r.sent_s > bound for r in in_flight)
            reason = self._over(s, late)
            if reason:
                return reason
        return None


@dataclass(frozen=True)
class SweepStep:
    rate: float  # requests/s offered
    phase: str  # grow | shrink | bisect
    meets_slo: bool
    summary: Summary
    stop_reason: str | None  # set when the step was stopped early


@dataclass
class SweepReport:
    """All steps in the order run, and the best rate (None when even min_rate fails)."""

    config: LoadTestConfig
    sweep_config: SweepConfig
    steps: list[SweepStep]
    best_rate: float | None
    reports: list[Report]  # one per step, same order
    interrupted: bool = False  # Ctrl-C ended the sweep (sweep(..., stop_on_sigint=True)); best of the steps run

    @property
    def best(self) -> SweepStep | None:
        passing = [s for s in self.steps if s.meets_slo and s.rate == self.best_rate]
        return passing[0] if passing else None


async def search(evaluate: Callable[[float, str], Awaitable[bool]], sc: SweepConfig) -> float | None:
    """Bracket and bisect with `evaluate(rate, phase) -> passed`; at most sc.max_steps calls."""
    steps = 0

    async def ok(rate: float, phase: str) -> bool:
        nonlocal steps
        steps += 1
        return await evaluate(rate, phase)

    rate, lo, hi = sc.start_rate, None, None
    if await ok(rate, "grow"):
        lo = rate
        while rate < sc.max_rate and steps < sc.max_steps:
            rate = min(rate * 2.0, sc.max_rate)
            if await ok(rate, "grow"):
                lo = rate
            else:
                hi = rate
                break
    else:
        hi = rate
        while rate / 2.0 >= sc.min_rate and steps < sc.max_steps:
            rate /= 2.0
            if await ok(rate, "shrink"):
                lo = rate
                break
            hi = rate
    if lo is None or hi is None:
        return lo  # nothing passes, or max_rate passes
    while hi / lo - 1.0 > sc.tolerance and steps < sc.max_steps:
        mid = (lo + hi) / 2.0
        if await ok(mid, "bisect"):
            lo = mid
        else:
            hi = mid
    return lo


def _check(config: LoadTestConfig) -> None:
    if not config.slos:
        raise ConfigError("slos (--slo): a sweep needs at least one SLO, e.g. --slo ttft_p99_ms=500")
    if is_closed_loop(config):
        raise ConfigError(
            "closed_loop_concurrency (--closed-loop-concurrency): a sweep varies the open-loop rate"
        )
    if config.trace is not None:
        raise ConfigError("trace (--trace): a sweep sets its own rates; use --time-scale to replay faster")


class _Interrupted(Exception):
    """Ctrl-C stopped a step: the search ends, and the steps run so far are the result."""


async def sweep_async(
    config: LoadTestConfig,
    sc: SweepConfig,
    on_step: Callable[[SweepStep], None] | None = None,
    stop_on_sigint: bool = False,
) -> SweepReport:
    """Run the sweep in the caller's event loop; `on_step` sees each step as it finishes. With
    `stop_on_sigint`, a Ctrl-C during a step ends the sweep with the steps run so far."""
    _check(config)
    if config.num_prompts is None and config.duration is None:
        config = replace(config, duration=DEFAULT_STEP_DURATION_S)
    steps: list[SweepStep] = []
    reports: list[Report] = []

    async def evaluate(rate: float, phase: str) -> bool:
        step_config = replace(
            config, request_rate=rate, preflight=config.preflight and not steps, progress=False
        )
        if sc.min_step_s > 0:  # a sustained load, not a burst (SweepConfig.min_step_s)
            if config.num_prompts is not None:
                step_config = replace(step_config, num_prompts=max(config.num_prompts, math.ceil(rate * sc.min_step_s)))
            else:
                step_config = replace(step_config, duration=max(config.duration, sc.min_step_s))
        monitor = SloMonitor(config.slos) if sc.early_stop else None
        report = await run_async(step_config, monitor, stop_on_sigint)
        if report.stop_reason is not None and not report.interrupted:
            await wait_until_idle(step_config)  # let the server drain what the stopped step queued
        passed = bool(report.summary.meets_slo) and report.stop_reason is None
        step = SweepStep(rate, phase, passed, report.summary, report.stop_reason)
        steps.append(step)
        reports.append(report)
        if on_step is not None:
            on_step(step)
        if report.interrupted:
            raise _Interrupted
        return passed

    try:
        best = await search(evaluate, sc)
    except _Interrupted:
        passing = [s.rate for s in steps if s.meets_slo]
        return SweepReport(config, sc, steps, max(passing, default=None), reports, interrupted=True)
    return SweepReport(config, sc, steps, best, reports)


def sweep(
    config: LoadTestConfig,
    sc: SweepConfig | None = None,
    on_step: Callable[[SweepStep], None] | None = None,
    stop_on_sigint: bool = False,
) -> SweepReport:
    """Find the highest request rate meeting every SLO in config.slos (blocking)."""
    return run_in_new_loop(sweep_async(config, sc or SweepConfig(), on_step, stop_on_sigint))
