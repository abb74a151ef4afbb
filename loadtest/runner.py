"""The run loop: one asyncio event loop, a precomputed schedule, one task per request.

Open loop (the default): the dispatcher sleeps until each due time and starts the request's task;
it never waits for replies, so a slow server cannot slow the schedule (no coordinated omission).
Each record keeps its scheduled and actual send times; their difference (send lag) shows when the
generator itself, or a --max-concurrency cap, held a send back. Closed loop: N workers, each sends
its next request when its last one finished.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import math
import signal
from dataclasses import dataclass
from datetime import UTC, datetime
from time import perf_counter
from typing import Protocol

import aiohttp
import numpy as np

from loadtest.arrivals import schedule
from loadtest.clients import make_client
from loadtest.config import CLOSED_LOOP_POOL, LoadTestConfig, check_runnable, is_closed_loop, measured_count
from loadtest.metrics import RequestRecord, Summary, summarize
from loadtest.prompts import PromptBuilder
from loadtest.workload import RequestSpec, from_dataset, from_trace, synthetic

TICK_S = 0.1  # progress-bar and monitor period
INTERRUPTED = "interrupted (Ctrl-C): the results cover the requests sent until then"


@dataclass(frozen=True)
class Plan:
    """What will be sent: due times (open loop) and the request of each index."""

    times: np.ndarray | None  # s from the start, one per request; None for a closed loop
    specs: list[RequestSpec]  # open loop: one per request; closed loop: a pool used in turn
    total: int | None  # requests to send; None = until the duration (closed loop)
    warmup: int


@dataclass
class Report:
    """The outcome of one run: its config, per-request records and the summary."""

    config: LoadTestConfig
    summary: Summary
    records: list[RequestRecord]
    started_at: str  # ISO 8601 wall-clock time of the first send
    stop_reason: str | None = None  # set when a monitor (or Ctrl-C) ended the run early
    interrupted: bool = False  # Ctrl-C ended it (run(..., stop_on_sigint=True))


class RunMonitor(Protocol):
    """Watches a run and returns a reason to stop it early, or None (see slo_sweep.SloMonitor)."""

    def on_start(self, planned: int | None) -> None: ...

    def on_complete(self, rec: RequestRecord) -> str | None: ...

    def on_tick(self, in_flight: list[RequestRecord], now_s: float) -> str | None: ...


def build_plan(config: LoadTestConfig, builder: PromptBuilder) -> Plan:
    """Precompute the schedule and every request (prompts are built before the clock starts)."""
    check_runnable(config)
    count = measured_count(config)
    total = None if count is None else count + config.warmup

    def make(n: int) -> list[RequestSpec]:
        return from_dataset(config, n, builder) if config.dataset else synthetic(config, n, builder)

    if is_closed_loop(config):
        return Plan(None, make(total or CLOSED_LOOP_POOL), total, config.warmup)
    if config.trace is not None:
        times, specs = from_trace(config, builder, total)
    else:
        times = schedule(
            config.arrival, config.request_rate, config.burstiness, total, config.duration, config.seed
        )
        if total is None and config.warmup:  # warm-up comes on top of the measured duration
            times = schedule(
                config.arrival, config.request_rate, config.burstiness, len(times) + config.warmup,
                None, config.seed,
            )  # fmt: skip
        specs = make(len(times))
    return Plan(times, specs, len(times), config.warmup)


def _raise_fd_limit(need: int) -> None:
    """An open loop at a high rate can hold thousands of connections; lift the soft fd limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, need + 256)
        if soft < need + 256 and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


class _Runner:
    def __init__(
        self, config: LoadTestConfig, plan: Plan, builder: PromptBuilder, monitor: RunMonitor | None,
        stop_on_sigint: bool = False,
    ) -> None:
        self.config, self.plan, self.builder, self.monitor = config, plan, builder, monitor
        self.stop_on_sigint = stop_on_sigint
        self.interrupted = False
        self.records: list[RequestRecord] = []
        self.in_flight: dict[int, RequestRecord] = {}
        self.tasks: set[asyncio.Task] = set()
        self.max_in_flight = 0
        self.errors = 0
        self.stop_reason: str | None = None
        self.t0 = 0.0
        self.client = None
        self.pbar = None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            for task in list(self.tasks):
                task.cancel()

    def _on_sigint(self) -> None:
        """First Ctrl-C: stop as a monitor would, so the caller can still write what was measured;
        the handler is removed, so a second Ctrl-C interrupts at once."""
        self.interrupted = True
        self.stop(INTERRUPTED)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    def _sigint_handler(self, install: bool) -> None:
        if not self.stop_on_sigint:
            return
        loop = asyncio.get_running_loop()
        try:  # only the main thread of a Unix process can take signals
            if install:
                loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            else:
                loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    async def _one(self, rec: RequestRecord, spec: RequestSpec, sem: asyncio.Semaphore | None) -> None:
        try:
            if sem is None:
                self.in_flight[rec.index] = rec
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
                await self.client.send(spec, rec, self.t0)
            else:
                async with sem:  # waiting here shows as send lag: the cap, not the schedule, held it
                    self.in_flight[rec.index] = rec
                    self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
                    await self.client.send(spec, rec, self.t0)
        except asyncio.CancelledError:
            rec.fail("cancelled", f"the run stopped early: {self.stop_reason}")
            rec.done_s = perf_counter() - self.t0
            raise
        finally:
            self.in_flight.pop(rec.index, None)
            if not rec.ok:
                self.errors += 1
            if self.pbar is not None:
                self.pbar.update(1)
            if self.monitor is not None and not rec.warmup and self.stop_reason is None:
                reason = self.monitor.on_complete(rec)
                if reason:
                    self.stop(reason)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _open_loop(self) -> None:
        cap = self.config.max_concurrency
        sem = asyncio.Semaphore(cap) if cap else None
        times, specs, warmup = self.plan.times.tolist(), self.plan.specs, self.plan.warmup
        for i, due in enumerate(times):
            # a loop timer may fire up to a millisecond early (uvloop rounds): never send early
            while (delay := self.t0 + due - perf_counter()) > 0:
                await asyncio.sleep(delay)
            if self.stop_reason is not None:
                break
            rec = RequestRecord(index=i, warmup=i < warmup, scheduled_s=due)
            self.records.append(rec)
            self._spawn(self._one(rec, specs[i], sem))

    async def _closed_loop(self) -> None:
        counter = itertools.count()
        specs, total, duration = self.plan.specs, self.plan.total, self.config.duration

        async def worker() -> None:
            while self.stop_reason is None:
                i = next(counter)
                now = perf_counter() - self.t0
                if (total is not None and i >= total) or (duration is not None and now >= duration):
                    return
                rec = RequestRecord(index=i, warmup=i < self.plan.warmup, scheduled_s=now)
                self.records.append(rec)
                await self._one(rec, specs[i % len(specs)], None)

        for _ in range(self.config.closed_loop_concurrency):
            self._spawn(worker())

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = perf_counter() - self.t0
            if self.pbar is not None:
                self.pbar.set_postfix(errors=self.errors, in_flight=len(self.in_flight), refresh=False)
            if self.monitor is not None and self.stop_reason is None:
                live = [r for r in self.in_flight.values() if not r.warmup and not math.isnan(r.sent_s)]
                reason = self.monitor.on_tick(live, now)
                if reason:
                    self.stop(reason)

    async def run(self) -> Report:
        from tqdm.auto import tqdm

        config = self.config
        cap = config.max_concurrency or config.closed_loop_concurrency or 0
        _raise_fd_limit(cap or (self.plan.total or 1024))
        connector = aiohttp.TCPConnector(
            limit=cap, limit_per_host=cap, keepalive_timeout=60, ttl_dns_cache=300
        )
        timeout = aiohttp.ClientTimeout(total=config.timeout, sock_connect=min(config.timeout, 30.0))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.client = make_client(config, session, self.builder)
            if config.preflight:
                await self.client.probe()
            self.pbar = tqdm(
                total=self.plan.total,
                unit="req",
                desc="loadtest",
                disable=not config.progress,
                dynamic_ncols=True,
            )
            started_at = datetime.now(UTC).isoformat()
            if self.monitor is not None:
                total = self.plan.total
                self.monitor.on_start(None if total is None else total - self.plan.warmup)
            # Freeze what exists (prompts, plan) out of the collector's reach: a full collection
            # walking it mid-run would stall the loop and show up as send lag. Only the young
            # generations are collected first (the garbage just made): a full collection walked every
            # object of the caller before each run: 0.19 s of CPU (0.3-1.4 s on a loaded 2-core host) in
            # `tune search --validate`'s process (torch, matplotlib: 245,000 objects), once per sweep step.
            gc.collect(1)
            gc.freeze()
            self.t0 = perf_counter()
            ticker = asyncio.get_running_loop().create_task(self._ticker())
            self._sigint_handler(install=True)
            try:
                if self.plan.times is None:
                    await self._closed_loop()
                else:  # a task, so that a stop cancels its wait for the next due time
                    dispatcher = self._spawn(self._open_loop())
                while self.tasks:
                    await asyncio.gather(*list(self.tasks), return_exceptions=True)
                if self.plan.times is not None and not dispatcher.cancelled() and dispatcher.exception():
                    raise dispatcher.exception()  # a bug in the dispatcher must not pass as a short run
            finally:
                self._sigint_handler(install=False)
                ticker.cancel()
                for task in list(self.tasks):
                    task.cancel()
                self.pbar.close()
                gc.unfreeze()
        summary = summarize(
            self.records,
            config.slos,
            open_loop=self.plan.times is not None,
            prompt_lengths="exact" if self.builder.exact else "approximate",
            max_in_flight=self.max_in_flight,
        )
        if self.stop_reason is not None:
            summary = _stopped(summary, self.stop_reason)
        return Report(config, summary, self.records, started_at, self.stop_reason, self.interrupted)


def _stopped(summary: Summary, reason: str) -> Summary:
    """A run a monitor cut short (its SLO could no longer be met) does not meet its SLO, whatever
    the requests that finished say."""
    from dataclasses import replace

    meets = None if summary.meets_slo is None else False
    return replace(summary, meets_slo=meets, warnings=(*summary.warnings, f"stopped early: {reason}"))


async def wait_until_idle(config: LoadTestConfig) -> float:
    """Send one short request and wait for its reply; returns the seconds it took. On a FIFO
    server the reply comes once the backlog ahead of it has drained, so a sweep calls this after
    stopping an over-saturated step: the next step must not inherit the last one's queue."""
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = make_client(config, session, PromptBuilder(None))
        rec = RequestRecord(index=-1, warmup=True, scheduled_s=0.0)
        t0 = perf_counter()
        await client.send(RequestSpec("Hello.", 2, 1), rec, t0)
        return perf_counter() - t0


async def run_async(
    config: LoadTestConfig, monitor: RunMonitor | None = None, stop_on_sigint: bool = False
) -> Report:
    """Run one load test inside the caller's event loop. With `stop_on_sigint` (the CLI's), a first
    Ctrl-C ends the run early and returns what was measured (Report.interrupted); without it Ctrl-C
    interrupts as usual, so a caller running many tests (the tuner) stops as a whole."""
    builder = PromptBuilder(config.tokenizer)
    plan = build_plan(config, builder)
    return await _Runner(config, plan, builder, monitor, stop_on_sigint).run()


def run_in_new_loop(coro, use_uvloop: bool = True):
    """Run a coroutine in a fresh event loop: uvloop's when it is installed and `use_uvloop`
    (it is faster; loadtest does not depend on it), else asyncio's."""
    factory = None
    if use_uvloop:
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def run(config: LoadTestConfig, monitor: RunMonitor | None = None, stop_on_sigint: bool = False) -> Report:
    """Run one load test and return its Report (blocking; use run_async inside an event loop)."""
    return run_in_new_loop(run_async(config, monitor, stop_on_sigint))
