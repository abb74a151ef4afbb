"""Overload figure for RELIABILITY.md: `shardserve serve` (real Ray Serve, real engine) with a TTFT
SLO, driven by `shardserve loadtest` in its own process at about twice the measured capacity.

1. capacity: a closed loop of max_num_seqs workers (every running slot busy, nobody queued) against
   the same model served without the SLO (the engine's own capacity: with the SLO, a closed loop
   that retries at once would measure how fast 429s come back);
2. overload: a fresh server with the SLO, open-loop Poisson arrivals at RATIO x that capacity for
   DURATION seconds.

Prints what the issue asks for: offered rate, requests, admitted (a first token and a complete
reply), 429s (with Retry-After, split into refused at the door and given up while waiting, from
the replica's /metrics), other errors, the admitted requests' TTFT p50 / p99 / max as the client
measured it against the SLO, the peak of sequences the replica held against its count bound, and
the serving processes' RSS before and after (memory bounded).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_overload.py [--shape default|gpt2-124m]
        [--slo-ms 500] [--ratio 2] [--duration 15] [--max-num-seqs 8]

The checkpoint has random weights of the named shape (tests/conftest.py's writer), so only its
step times matter; every request asks for exactly --output-len tokens (ignore_eos). Ray's files go
to a private RAY_TMPDIR, so no other Ray session is joined.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from training.distributed import free_port

SHAPES = {"default": {"n_embd": 384, "n_layer": 4, "n_head": 6},
          "gpt2-124m": {"n_embd": 768, "n_layer": 12, "n_head": 12}}


def cpu_model() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = re.search(r"model name\s*:\s*(.*)", text)
    flags = re.search(r"flags\s*:\s*(.*)", text)
    f = set(flags.group(1).split()) if flags else set()
    kind = "AMX" if "amx_bf16" in f else "AVX512-BF16" if "avx512_bf16" in f else "AVX2" if "avx2" in f else "?"
    return f"{name.group(1) if name else platform.processor()} ({kind}, {os.cpu_count()} cores)"


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and its children (Ray's workers included), MiB."""
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def loadtest(url: str, args, out: Path, *extra: str) -> dict:
    cmd = [str(ROOT / ".venv/bin/shardserve"), "loadtest", "--url", url, "--model", "m",
           "--input-dist", "fixed", "--random-input-len", str(args.input_len), "--output-dist", "fixed",
           "--random-output-len", str(args.output_len), "--ignore-eos", "--no-progress", "--no-plots",
           "--result-dir", str(out), "--timeout", "120", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((out / "summary.json").read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--ratio", type=float, default=2.0, help="offered rate / measured capacity")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of open-loop arrivals")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-waiting", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from conftest import make_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="ss-overload-", dir="/tmp"))
    model = make_checkpoint(tmp / "model", "gpt2", n_positions=512, **SHAPES[args.shape])

    def start(slo_ms: float | None, name: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port, "log_requests": False},
               "models": [{"name": "m", "path": str(model), "max_waiting": args.max_waiting, "retry_after_s": 1,
                           "ttft_slo_ms": slo_ms, "engine": {"max_num_seqs": args.max_num_seqs}}]}
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(tmp / "ray")}
        with open(tmp / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([str(ROOT / ".venv/bin/shardserve"), "serve", "--config", str(tmp / f"{name}.yaml")],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                stop(proc)
                raise SystemExit(f"server did not start: see {tmp / (name + '.log')}")
            time.sleep(0.5)

    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.2f}; shape {args.shape}; "
          f"max_num_seqs {args.max_num_seqs}, max_waiting {args.max_waiting}; ttft_slo_ms {args.slo_ms:g}")
    serve, url = start(None, "serve-capacity")
    try:
        cap = loadtest(url, args, tmp / "capacity", "--closed-loop-concurrency", str(args.max_num_seqs),
                       "--num-prompts", str(8 * args.max_num_seqs), "--warmup", str(args.max_num_seqs))
    finally:
        stop(serve)
    serve, url = start(args.slo_ms, "serve")
    try:
        # warm-up at the SLO server: one request at a time (the engine's first steps are slow)
        loadtest(url, args, tmp / "warmup", "--closed-loop-concurrency", "1", "--num-prompts", "4")
        capacity = cap["request_throughput"]
        rate = args.ratio * capacity
        before = httpx.get(f"{url}/metrics", timeout=10).text
        rss0 = tree_rss_mib(serve.pid)
        peak = {"seqs": 0.0, "rss": rss0}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                try:
                    m = httpx.get(f"{url}/metrics", timeout=5).text
                    peak["seqs"] = max(peak["seqs"], metric(m, "shardserve_num_sequences_admitted"))
                except httpx.HTTPError:
                    pass
                peak["rss"] = max(peak["rss"], tree_rss_mib(serve.pid))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        n = int(rate * args.duration)
        over = loadtest(url, args, tmp / "overload", "--request-rate", f"{rate:.3f}", "--arrival", "poisson",
                        "--num-prompts", str(n), "--seed", str(args.seed))
        done.set()
        watcher.join()
        time.sleep(1.0)
        after = httpx.get(f"{url}/metrics", timeout=10).text
        (tmp / "metrics_before.txt").write_text(before)
        (tmp / "metrics_after.txt").write_text(after)
        rss1 = tree_rss_mib(serve.pid)
        health = httpx.get(f"{url}/health", timeout=10).status_code

        def delta(reason: str) -> float:
            return (metric(after, "shardserve_requests_rejected_total", reason=reason)
                    - metric(before, "shardserve_requests_rejected_total", reason=reason))

        ttft = over["ttft_ms"]
        errors = over["errors"]
        others = {k: v for k, v in errors.items() if k != "http_429"}
        print(f"capacity {capacity:.2f} req/s (closed loop of {args.max_num_seqs}); offered {rate:.2f} req/s "
              f"(x{args.ratio:g}, Poisson) for {args.duration:g} s = {n} requests")
        print(f"admitted (complete) {over['completed']}; 429 {errors.get('http_429', 0)} "
              f"(the replica: {delta('ttft_slo'):.0f} given up while waiting, {delta('overloaded'):.0f} refusals at "
              f"the door, counting the gateway's retries of a door refusal); "
              f"other errors {others or 0}")
        print(f"TTFT of admitted (client side): p50 {ttft['p50']:.0f} ms, p99 {ttft['p99']:.0f} ms, "
              f"max {ttft['max']:.0f} ms against the {args.slo_ms:g} ms SLO: "
              f"{'within' if ttft['p99'] <= args.slo_ms else 'PAST'} it")
        slo_s = args.slo_ms / 1000

        def over_slo(text: str) -> tuple[float, float]:
            """(first tokens at the replica, those past the SLO) from its TTFT histogram (the SLO is a bucket
            edge for 250/500/750/1000 ms; otherwise the next edge above it, so an undercount)."""
            total = metric(text, "shardserve_time_to_first_token_seconds_count")
            edges = [float(m) for m in re.findall(r'time_to_first_token_seconds_bucket\{[^}]*le="([0-9.e+-]+)"', text)]
            edge = min((e for e in edges if e >= slo_s - 1e-9), default=float("inf"))
            within = metric(text, "shardserve_time_to_first_token_seconds_bucket", le=f"{edge}") if edges else 0
            return total, total - within

        n0, late0 = over_slo(before)
        n1, late1 = over_slo(after)
        steps = metric(after, "shardserve_engine_steps_total") - metric(before, "shardserve_engine_steps_total")
        busy = (metric(after, "shardserve_engine_busy_seconds_total")
                - metric(before, "shardserve_engine_busy_seconds_total"))
        print(f"replica side: {late1 - late0:.0f} of {n1 - n0:.0f} first tokens past the SLO; "
              f"{steps:.0f} engine steps, mean {1000 * busy / max(steps, 1):.0f} ms")
        print(f"peak sequences held {peak['seqs']:.0f} (count bound {args.max_num_seqs + args.max_waiting}); "
              f"serving processes RSS {rss0:.0f} -> peak {peak['rss']:.0f} -> {rss1:.0f} MiB; "
              f"admitted after {metric(after, 'shardserve_num_sequences_admitted'):.0f}; /health {health}")
        print(f"load average {os.getloadavg()[0]:.2f}; files: {tmp}")
    finally:
        stop(serve)


def stop(serve: subprocess.Popen) -> None:
    os.killpg(serve.pid, signal.SIGINT)
    try:
        serve.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
