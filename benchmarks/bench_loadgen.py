"""How fast can loadtest generate load? Its own capacity against a trivial streaming server.

Starts the fake streaming server (tests/loadtest_support/fake_llm_server.py) in a separate process
(127.0.0.1, ephemeral port, no injected delays, 16 tokens per reply as 16 SSE events + usage +
[DONE]), then ramps a constant-rate open-loop schedule and, at each rate, measures:

  achieved  send rate from the actual send times (target: the scheduled rate)
  thru      completed requests/s
  lag       send lag = actual - scheduled send time, p50 / p99 / max (ms)
  gen CPU   the generator process's CPU time / wall time (1.0 = one core saturated)
  srv CPU   the server process's CPU time / wall time

A rate passes when nothing failed, achieved and thru are >= 98% of the rate, and p99 lag <= 10 ms.
Targets (issue 6): >= 300 streamed requests/s with p99 send lag <= 10 ms. The report gives the
highest passing rate, its ratio to the target, and the lag at the first rate that fails.

    .venv/bin/python benchmarks/bench_loadgen.py                 # default ramp
    .venv/bin/python benchmarks/bench_loadgen.py --rates 300 --duration 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "loadtest_support"))

from launcher import FakeServer

from loadtest.config import LoadTestConfig
from loadtest.runner import run_async, run_in_new_loop

TARGET_RATE = 300.0  # streamed requests/s
TARGET_LAG_P99_MS = 10.0


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    url: str, rate: float, duration: float, tokens: int, use_uvloop: bool, server_pid: int, first: bool
) -> dict:
    config = LoadTestConfig(
        url=url,
        model="fake",
        arrival="constant",
        request_rate=rate,
        duration=duration,
        random_input_len=32,
        random_output_len=tokens,
        progress=False,
        preflight=first,
        seed=0,
    )
    cpu0, srv0, wall0 = time.process_time(), proc_cpu_s(server_pid), time.perf_counter()
    report = run_in_new_loop(run_async(config), use_uvloop=use_uvloop)
    wall = time.perf_counter() - wall0
    s = report.summary
    row = {
        "rate": rate,
        "requests": s.requests,
        "achieved": s.achieved_rate or 0.0,
        "thru": s.request_throughput,
        "lag_p50": s.send_lag_ms.p50,
        "lag_p99": s.send_lag_ms.p99,
        "lag_max": s.send_lag_ms.max,
        "tokens_per_req": s.total_output_tokens / max(s.completed, 1),
        "failed": s.failed,
        "gen_cpu": (time.process_time() - cpu0) / wall,
        "srv_cpu": (proc_cpu_s(server_pid) - srv0) / wall,
    }
    row["ok"] = (
        row["failed"] == 0
        and row["achieved"] >= 0.98 * rate
        and row["thru"] >= 0.98 * rate
        and row["lag_p99"] <= TARGET_LAG_P99_MS
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates",
        default="100,200,300,400,500,600,800,1000,1200,1500",
        help="comma-separated requests/s to ramp through",
    )
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of schedule per rate")
    parser.add_argument("--tokens", type=int, default=16, help="tokens (SSE events) per reply")
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="generator event loop (uvloop is used only if installed)",
    )
    parser.add_argument("--keep-going", action="store_true", help="do not stop at the second failing rate")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    use_uvloop = args.loop == "uvloop"
    try:
        import uvloop  # noqa: F401

        loop_name = args.loop
    except ImportError:
        loop_name = "asyncio (uvloop not installed)"
    print(
        f"loadtest generator capacity: {args.tokens} tokens/reply, {args.duration:g} s per rate, "
        f"loop {loop_name}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    header = (
        f"{'rate':>7} {'reqs':>6} {'achieved':>9} {'thru':>8} {'lag p50':>8} {'lag p99':>8} "
        f"{'lag max':>8} {'gen CPU':>8} {'srv CPU':>8} {'fail':>5}  ok"
    )
    print(header)
    rows, fails = [], 0
    with FakeServer(uvloop=True) as server:
        for i, rate in enumerate(rates):
            row = measure(server.url, rate, args.duration, args.tokens, use_uvloop, server.proc.pid, i == 0)
            rows.append(row)
            print(
                f"{row['rate']:7.0f} {row['requests']:6d} {row['achieved']:9.1f} {row['thru']:8.1f} "
                f"{row['lag_p50']:8.2f} {row['lag_p99']:8.2f} {row['lag_max']:8.2f} {row['gen_cpu']:8.2f} "
                f"{row['srv_cpu']:8.2f} {row['failed']:5d}  {'yes' if row['ok'] else 'NO'}",
                flush=True,
            )
            fails += not row["ok"]
            if fails >= 2 and not args.keep_going:
                break
    passing = [r for r in rows if r["ok"]]
    best = max((r["rate"] for r in passing), default=0.0)
    broke = next((r for r in rows if not r["ok"] and r["rate"] > best), None)
    print()
    print(
        f"highest passing rate: {best:.0f} req/s = {best / TARGET_RATE:.2f} x the {TARGET_RATE:.0f} req/s target"
    )
    at_target = next((r for r in rows if r["rate"] == TARGET_RATE), None)
    if at_target is not None:
        print(
            f"at {TARGET_RATE:.0f} req/s: p99 send lag {at_target['lag_p99']:.2f} ms "
            f"({at_target['lag_p99'] / TARGET_LAG_P99_MS:.2f} x the {TARGET_LAG_P99_MS:.0f} ms limit), "
            f"achieved {at_target['achieved']:.1f} req/s, {at_target['failed']} failed"
        )
    if broke is not None:
        print(
            f"breaks at {broke['rate']:.0f} req/s: p99 send lag {broke['lag_p99']:.2f} ms, achieved "
            f"{broke['achieved']:.1f}, completed {broke['thru']:.1f} req/s, generator CPU {broke['gen_cpu']:.2f}, "
            f"server CPU {broke['srv_cpu']:.2f}"
        )
    else:
        print("did not break within the ramp; extend --rates")


if __name__ == "__main__":
    main()
