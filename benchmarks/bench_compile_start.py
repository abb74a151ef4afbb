"""Start time of an engine with compile_decode="on": a first start (empty inductor cache) and a second.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_compile_start.py [--dtypes bfloat16,float32]

GPT-2-124M shape, random weights (the peer benchmark's model directory), 4 GiB of KV cache. Each
start runs in a fresh process (import + load + compile, as a server start would), both starts on
the same new cache directory; the ratio printed is against the 30 s second-start budget of
`make serve` (issue 12) and against an eager start (compile_decode off) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 30.0


def child(model: str, dtype: str, mode: str) -> None:
    t = time.perf_counter()
    from engines import LLM

    llm = LLM(model, dtype=dtype, kv_cache_bytes=4 << 30, compile_decode=mode)
    from torch._dynamo.utils import counters

    # cache hits and misses of inductor's FX graph cache and AOTAutograd's: a second start that
    # traced the same graphs hits both (a miss means the graph or its inputs changed between starts)
    cache = {"fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
             "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
             "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}
    print("RESULT " + json.dumps({"start_s": time.perf_counter() - t, "compile_s": llm.engine.executor.runner.compile_s,
                                  "cache": cache}))


def start(model: Path, dtype: str, mode: str, cache: Path) -> dict:
    # the Linear kernel choices (engines/fast_linear.py) persist beside the inductor cache: a first
    # start times them, a second reuses them, as on a user's machine
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "SHARDSERVE_FAST_LINEAR_CACHE": str(cache / "fast_linear.json")}
    r = subprocess.run([sys.executable, __file__, "--child", mode, "--dtype", dtype, "--model", str(model)],
                       capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(f"start failed (rc {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.dtype, args.child)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_peer_vllm import make_model
    from benchmarks.common import CACHE

    model = make_model(CACHE / "peer-gpt2-124m-hf")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-compile-start-") as cache:
            eager = start(model, dtype, "off", Path(cache))
            first = start(model, dtype, "on", Path(cache))
            second = start(model, dtype, "on", Path(cache))
        print(f"{dtype:9s} eager start {eager['start_s']:.1f} s | compiled first start {first['start_s']:.1f} s "
              f"(compile {first['compile_s']:.1f} s) | second start {second['start_s']:.1f} s (compile "
              f"{second['compile_s']:.1f} s) = {second['start_s'] / BUDGET_S:.2f}x the {BUDGET_S:.0f} s budget | "
              f"caches first {first['cache']} second {second['cache']} | "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
