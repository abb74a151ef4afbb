"""shardserve's load generator: open-loop LLM load against any OpenAI-compatible or KServe v2
server, with TTFT / TPOT / ITL / goodput, SLO sweeps, reports and plots.

Python API (the tuner uses it):

    from loadtest import LoadTestConfig, SLO, SweepConfig, run, sweep
    report = run(LoadTestConfig(url="http://127.0.0.1:8000", model="m", request_rate=10, num_prompts=200))
    report.summary.ttft_ms.p99

Imports no torch and no other shardserve package. Heavy modules (aiohttp, numpy, matplotlib) load
on first use, so importing the CLI stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loadtest.config import SLO, LengthDist, LengthPair, LoadTestConfig, SweepConfig
from loadtest.errors import ConfigError, LoadTestError

if TYPE_CHECKING:
    from loadtest.runner import Report
    from loadtest.slo_sweep import SweepReport


def run(config: LoadTestConfig) -> Report:
    """Run one load test (blocking) and return its Report."""
    from loadtest.runner import run as _run

    return _run(config)


def sweep(config: LoadTestConfig, sweep_config: SweepConfig | None = None) -> SweepReport:
    """Find the highest request rate whose run meets every SLO in config.slos (blocking)."""
    from loadtest.slo_sweep import sweep as _sweep

    return _sweep(config, sweep_config or SweepConfig())


__all__ = [
    "SLO",
    "ConfigError",
    "LengthDist",
    "LengthPair",
    "LoadTestConfig",
    "LoadTestError",
    "SweepConfig",
    "run",
    "sweep",
]
