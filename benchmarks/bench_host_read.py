"""This host's memory read rate over time: how far apart repetitions of a memory-bound workload can be here.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_host_read.py [--seconds 600] [--interval 0.25] [--mb 256]

Batch-1 decode streams every weight once a token, so its rate follows the host's read rate. On a shared VM that rate is
the host's, not ours: this script samples it (an fp32 sum over a buffer larger than the caches, best of two, every
--interval seconds, all cores) from two buffers in turn, one in 2 MB pages and one in 4 KB pages, so that a change seen
in both at once is the host's state and not where our pages happen to lie. Printed: the CPU, the spread of the
samples, how long the host stays above and below the middle of its range, and for repetitions of W seconds (the
time-weighted read of each W-second window) how often three back-to-back windows agree within 10 %: the best any
workload bound by this read could do on the `max/min <= 1.1` point of bench_peer_vllm.py. A PNG of the timeline and the
samples (JSON) go to runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOWS = (5, 10, 20, 60)
"""Repetition lengths (s) the summary looks at; a bench_peer batch-1 repetition of ours is ~4-6 s."""


def windows(times: list[float], rates: list[float], w: float) -> list[float]:
    """The read of each back-to-back w-second window: its samples' harmonic mean (a fixed amount of reading takes
    the mean of their times), windows with no sample left out."""
    out, start = [], times[0]
    while start + w <= times[-1]:
        seg = [r for t, r in zip(times, rates) if start <= t < start + w]
        if seg:
            out.append(len(seg) / sum(1 / r for r in seg))
        start += w
    return out


def dwell(times: list[float], rates: list[float], split: float) -> dict[str, list[float]]:
    """Seconds of each stay above ('fast') and below ('slow') `split` GB/s, in order."""
    out: dict[str, list[float]] = {"fast": [], "slow": []}
    state, since = rates[0] >= split, times[0]
    for t, r in zip(times, rates):
        if (r >= split) != state:
            out["fast" if state else "slow"].append(t - since)
            state, since = r >= split, t
    out["fast" if state else "slow"].append(times[-1] - since)
    return out


def plot(path: Path, series: dict[str, tuple[list[float], list[float]]], cpu: str) -> None:
    """The samples of each buffer against time (matplotlib's object API with the Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (ts, rs) in series.items():
        ax.plot(ts, rs, lw=0.8, label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("streaming read, GB/s")
    ax.set_title(cpu, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from tqdm.auto import tqdm

    from benchmarks.common import cpu_line, read_bandwidth
    from engines.cpu.host_memory import huge_page_zeros

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="how long to sample (600)")
    ap.add_argument("--interval", type=float, default=0.25, help="pause between samples, seconds (0.25)")
    ap.add_argument("--mb", type=int, default=256, help="each buffer's size, MB; beyond the caches (256)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "host_read", help="path stem of the .png and .json")
    args = ap.parse_args()
    if args.seconds < 3 * max(WINDOWS):
        ap.error(f"--seconds: at least {3 * max(WINDOWS)} (three of the longest window), got {args.seconds}")
    if args.interval < 0 or args.mb < 64:
        ap.error(f"--interval must be >= 0 and --mb >= 64 (beyond the caches); got {args.interval}, {args.mb}")
    n = args.mb << 18  # fp32 elements
    huge = huge_page_zeros(n * 4)
    bufs = {"2 MB pages": (huge.view(torch.float32) if huge is not None else torch.empty(n)).fill_(1.0),
            "4 KB pages": torch.ones(n)}
    if huge is None:
        print("2 MB pages: not available here (huge_page_zeros); both buffers are ordinary memory")
    cpu = f"{cpu_line()}, {torch.get_num_threads()} threads"
    print(f"{cpu}; load {os.getloadavg()[0]:.1f} at the start (other work on these cores reads memory too)", flush=True)
    series: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in bufs}
    t0 = time.perf_counter()
    with tqdm(total=round(args.seconds), unit="s", desc="sampling the read", dynamic_ncols=True, mininterval=5) as bar:
        while (now := time.perf_counter() - t0) < args.seconds:
            for label, x in bufs.items():
                ts, rs = series[label]
                rate = read_bandwidth(repeats=2, x=x) / 1e9
                ts.append(time.perf_counter() - t0)
                rs.append(rate)
            bar.update(round(now) - bar.n)
            time.sleep(args.interval)
    ts, rs = series["2 MB pages"]
    lo, hi = statistics.quantiles(rs, n=20)[0], statistics.quantiles(rs, n=20)[-1]
    split = (lo + hi) / 2
    print(f"{len(rs)} samples a buffer over {ts[-1]:.0f} s, 2 MB pages: median {statistics.median(rs):.1f} GB/s, "
          f"5-95 % {lo:.1f}-{hi:.1f}, min {min(rs):.1f}, max {max(rs):.1f}; 4 KB pages: median "
          f"{statistics.median(series['4 KB pages'][1]):.1f}; load {os.getloadavg()[0]:.1f} at the end")
    same = sum((a >= split) == (b >= split) for a, b in zip(rs, series["4 KB pages"][1])) / len(rs)
    print(f"both buffers on the same side of {split:.1f} GB/s in {same:.0%} of the ticks (a host state, not placement)")
    stays = dwell(ts, rs, split)
    for state, d in stays.items():
        if d:
            print(f"  {state:4s} (>= / < {split:.1f}): {len(d)} stays, {sum(d) / ts[-1]:.0%} of the time, median "
                  f"{statistics.median(d):.1f} s, longest {max(d):.1f} s")
    summary = {"cpu": cpu, "split_gbs": split, "windows": {}}
    for w in WINDOWS:
        ws = windows(ts, rs, w)
        triples = [max(ws[i:i + 3]) / min(ws[i:i + 3]) for i in range(len(ws) - 2)]
        if not triples:
            continue
        ok = sum(t <= 1.1 for t in triples) / len(triples)
        summary["windows"][w] = {"reads": ws, "three_within_10pc": ok}
        print(f"  repetitions of {w:3d} s: {len(ws)} windows, max/min of all {max(ws) / min(ws):.2f}; three back to "
              f"back within 10 %: {ok:.0%} of {len(triples)} (median max/min {statistics.median(triples):.2f}, "
              f"worst {max(triples):.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(args.out.with_suffix(".png"), series, cpu)
    args.out.with_suffix(".json").write_text(json.dumps({**summary, "samples": series}))
    print(f"wrote {args.out.with_suffix('.png')} and .json")


if __name__ == "__main__":
    main()
