"""Gloo all-reduce and send/recv costs between two local processes (for `shardserve tune profile`).

Each cost is fitted as latency + bytes / bandwidth from a small and a large message; an
all-reduce over 2 ranks moves 2 (n-1)/n = 1 x its bytes per rank (ring), as the cost model assumes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

SIZES = (256, 4 * 2**20)  # bytes: latency-bound and bandwidth-bound messages
REPS = 20


def _worker(rank: int, world: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for kind in ("allreduce", "send"):
            times = []
            for _ in range(REPS + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(x)
                elif rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)  # ping-pong: half the round trip is one send
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
                dt = time.perf_counter() - t0
                times.append(dt / (2 if kind == "send" else 1))
            res[(kind, nbytes)] = sorted(times[2:])[len(times[2:]) // 2]  # median after warm-up
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def measure_gloo(world: int = 2, timeout_s: float = 60.0) -> dict[str, float]:
    """{allreduce_latency_us, allreduce_gb_s, send_latency_us, send_gb_s} over gloo on 127.0.0.1."""
    from tuner.server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    small, large = SIZES
    out = {}
    for kind in ("allreduce", "send"):
        t_small, t_large = res[(kind, small)], res[(kind, large)]
        moved = 2 * (world - 1) / world if kind == "allreduce" else 1.0
        bw = moved * (large - small) / max(t_large - t_small, 1e-9)
        out[f"{kind}_latency_us"] = max(t_small - moved * small / bw, 0.0) * 1e6
        out[f"{kind}_gb_s"] = bw / 1e9
    return out
