"""How fast can loadtest generate load? Its own capacity against a trivial streaming server.

Starts the fake streaming server (tests/loadtest_support/fake_llm_server.py) in a separate process
(127.0.0.1, ephemeral port, no injected delays, 16 tokens per reply as 16 SSE events + usage +
[DONE]), then ramps a constant-rate open-loop schedule. Each rate runs `--trials` times; per trial:

  achieved  send rate from the actual send times (target: the scheduled rate)
  thru      completed requests/s
  lag       send lag = actual - scheduled send time, p50 / p99 / max (ms)
  gen CPU   the generator process's CPU time / wall time (1.0 = one core saturated)
  srv CPU   the server process's CPU time / wall time
  stall     p99 / max lateness (ms) of a third process that only sleeps 2 ms in a loop during the
            trial: the machine's own scheduling stalls, which no generator can beat

A trial passes when nothing failed, achieved and thru are >= 98% of the rate, and p99 lag <= 10 ms.
A rate passes when its best trial does (the generator's capability; a shared machine's transient
stalls are shown in the stall column and in the other trials). Targets (issue 6): >= 300 streamed
requests/s with p99 send lag <= 10 ms. The report gives the highest passing rate, its ratio to the
target, and the lag at the first rate that fails.

    .venv/bin/python benchmarks/bench_loadgen.py                  # default ramp, 3 trials per rate
    .venv/bin/python benchmarks/bench_loadgen.py --rates 300 --trials 5 --duration 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from loadtest_support.launcher import FakeServer

from loadtest.config import LoadTestConfig
from loadtest.runner import run_async, run_in_new_loop

TARGET_RATE = 300.0  # streamed requests/s
TARGET_LAG_P99_MS = 10.0

# Sleeps 2 ms at a time until its stdin closes, then prints its p99 and max lateness in ms.
_STALL_PROBE = """
import sys, threading, time
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
late = []
while not done.is_set():
    t = time.perf_counter(); time.sleep(0.002); late.append(time.perf_counter() - t - 0.002)
late.sort()
print(f"{late[int(0.99 * (len(late) - 1))] * 1e3:.3f} {late[-1] * 1e3:.3f}")
"""


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trial(
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
    probe = subprocess.Popen(
        [sys.executable, "-c", _STALL_PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    cpu0, srv0, wall0 = time.process_time(), proc_cpu_s(server_pid), time.perf_counter()
    report = run_in_new_loop(run_async(config), use_uvloop=use_uvloop)
    wall = time.perf_counter() - wall0
    gen_cpu, srv_cpu = (time.process_time() - cpu0) / wall, (proc_cpu_s(server_pid) - srv0) / wall
    stall_p99, stall_max = map(float, probe.communicate(timeout=30)[0].split())
    s = report.summary
    row = {
        "rate": rate,
        "requests": s.requests,
        "achieved": s.achieved_rate or 0.0,
        "thru": s.request_throughput,
        "lag_p50": s.send_lag_ms.p50,
        "lag_p99": s.send_lag_ms.p99,
        "lag_max": s.send_lag_ms.max,
        "failed": s.failed,
        "gen_cpu": gen_cpu,
        "srv_cpu": srv_cpu,
        "stall_p99": stall_p99,
        "stall_max": stall_max,
    }
    row["ok"] = (
        row["failed"] == 0
        and row["achieved"] >= 0.98 * rate
        and row["thru"] >= 0.98 * rate
        and row["lag_p99"] <= TARGET_LAG_P99_MS
    )
    return row


HEADER = (
    f"{'rate':>6} {'try':>3} {'reqs':>6} {'achieved':>8} {'thru':>7} {'lag p50':>7} {'lag p99':>7} {'lag max':>7} "
    f"{'gen CPU':>7} {'srv CPU':>7} {'stall p99':>9} {'stall max':>9} {'fail':>4}  ok"
)


def fmt(row: dict, k: int) -> str:
    return (
        f"{row['rate']:6.0f} {k:3d} {row['requests']:6d} {row['achieved']:8.1f} {row['thru']:7.1f} "
        f"{row['lag_p50']:7.2f} {row['lag_p99']:7.2f} {row['lag_max']:7.1f} {row['gen_cpu']:7.2f} "
        f"{row['srv_cpu']:7.2f} {row['stall_p99']:9.2f} {row['stall_max']:9.1f} {row['failed']:4d}  "
        f"{'yes' if row['ok'] else 'NO'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", default="100,200,300,400,600,800,1000,1200,1500", help="requests/s to ramp through"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of schedule per trial")
    parser.add_argument(
        "--trials", type=int, default=3, help="trials per rate; a rate passes on its best trial"
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens (SSE events) per reply")
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="generator event loop"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    use_uvloop = args.loop == "uvloop"
    try:
        import uvloop  # noqa: F401

        loop_name = args.loop
    except ImportError:
        loop_name = "asyncio (uvloop not installed)"
    print(
        f"loadtest generator capacity: {args.tokens} tokens/reply, {args.duration:g} s x {args.trials} trials "
        f"per rate, loop {loop_name}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    print(HEADER)
    best_rows, first = [], True
    with FakeServer(uvloop=True) as server:
        for rate in rates:
            trials = []
            for k in range(args.trials):
                row = trial(server.url, rate, args.duration, args.tokens, use_uvloop, server.proc.pid, first)
                first = False
                trials.append(row)
                print(fmt(row, k + 1), flush=True)
                if row["ok"]:
                    break  # the rate passes; no need for more trials
            best = min(trials, key=lambda r: (not r["ok"], r["lag_p99"]))
            best["trials"] = trials
            best_rows.append(best)
            if not best["ok"] and len(best_rows) >= 2 and not best_rows[-2]["ok"]:
                break  # two rates in a row failed every trial
    passing = [r for r in best_rows if r["ok"]]
    top = max((r["rate"] for r in passing), default=0.0)
    broke = next((r for r in best_rows if not r["ok"] and r["rate"] > top), None)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print(
        f"highest passing rate: {top:.0f} req/s = {top / TARGET_RATE:.2f} x the {TARGET_RATE:.0f} req/s target"
    )
    at = next((r for r in best_rows if r["rate"] == TARGET_RATE), None)
    if at is not None:
        all_p99 = ", ".join(f"{t['lag_p99']:.2f}" for t in at["trials"])
        print(
            f"at {TARGET_RATE:.0f} req/s (best trial): p99 send lag {at['lag_p99']:.2f} ms = "
            f"{at['lag_p99'] / TARGET_LAG_P99_MS:.2f} x the {TARGET_LAG_P99_MS:.0f} ms limit, achieved "
            f"{at['achieved']:.1f} req/s, generator CPU {at['gen_cpu']:.2f}; p99 of every trial: {all_p99} ms"
        )
    if broke is not None:
        print(
            f"breaks at {broke['rate']:.0f} req/s (best trial): p99 send lag {broke['lag_p99']:.2f} ms, achieved "
            f"{broke['achieved']:.1f}, completed {broke['thru']:.1f} req/s, generator CPU {broke['gen_cpu']:.2f}, "
            f"server CPU {broke['srv_cpu']:.2f}, machine stall max {broke['stall_max']:.1f} ms"
        )
    else:
        print("did not break within the ramp; extend --rates")


if __name__ == "__main__":
    main()
