"""`shardserve tune profile`: measure this machine into a HardwareProfile YAML.

Measured: dense matmul rate per dtype at a decode-like and a prefill-like row count (the faster
is the peak; flops_efficiency is 1 since the rate is already what torch reaches), read
bandwidth (a reduction over a buffer far larger than the caches), memory. Not yet measured:
the engine's per-step fixed cost, attention cost per context token, gloo collective and send
costs, Ray and gateway overhead (they keep the defaults; see the report of the SLO-tuner issue).
"""

from __future__ import annotations

import os
import time

from tuner.profiles import HardwareProfile


def _best(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(name: str = "this-machine", size: int = 1024, rows: tuple[int, ...] = (16, 512)) -> HardwareProfile:
    import torch

    rates: dict[str, float] = {}
    for dtype in ("float32", "bfloat16"):
        w = torch.randn(size, size, dtype=getattr(torch, dtype))
        best = 0.0
        for n in rows:
            x = torch.randn(n, size, dtype=w.dtype)
            best = max(best, 2 * n * size * size / _best(lambda x=x, w=w: x @ w))
        rates[dtype] = round(best / 1e12, 6)
    buf = torch.ones(64 * 2**20 // 4, dtype=torch.float32)  # 64 MiB, past the last-level cache
    bw = buf.numel() * 4 / _best(lambda: buf.sum()) / 1e9
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return HardwareProfile(
        name=name, kind="measured", memory_gib=round(mem_gib, 1), hbm_bandwidth_gb_s=round(bw, 2),
        flops_tflops={**rates, "float16": rates["bfloat16"]}, intra_node_bandwidth_gb_s=round(bw / 4, 2),
        inter_node_bandwidth_gb_s=1.0, devices_per_node=1, bw_efficiency=1.0, flops_efficiency=1.0,
        fit_notes=f"measured by `shardserve tune profile` on {os.cpu_count()} CPUs; step, attention, collective "
                  "and gateway costs not measured (defaults)")
