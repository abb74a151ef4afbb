"""CPU threading for the engine: how idle OpenMP threads wait, and single-threaded tiny ops.

Two measured facts on a 2-core AMD EPYC shared with other processes (load average 4-8,
torch 2.13+cpu, libgomp), see BENCHMARKS.md, "Peer benchmark against vLLM's CPU build":

- libgomp's default lets a thread that finished its share of a parallel region spin for a while
  before it sleeps. When the machine is oversubscribed, the spinning thread burns the time slice
  its partner (or the Python thread that would issue the next op) needs, and every op with a
  parallel region waits for the scheduler: the decode step's per-sequence attention loop took
  123-916 ms per layer with 2 threads against 16 ms with idle threads sleeping
  (OMP_WAIT_POLICY=PASSIVE), and a (57 x 768) @ (768 x 2304) matmul 22.6 ms against 6.4 ms.
  On an idle machine a sleeping thread costs a futex wake-up (microseconds) per region.
  `configure_openmp_env` makes PASSIVE the default of a process that imports `engines` before
  torch; a user's own OMP_WAIT_POLICY always wins.
- With two threads on two cores shared with other work, every parallel region of the step waits
  for both threads to be scheduled: a batch-57 decode step took 1,860 ms on 2 threads against
  875 ms on 1 (load average 4.2-4.6). On the same machine idle (load ~1) it is the other way round:
  an offline mix of 24 requests ran at 94 / 73 tok/s on 2 threads against 71 / 66 on 1, batch-1
  decode level (BENCHMARKS.md). vLLM's CPU build binds its model to all cores but one (its scheduler
  runs beside the model); ours schedules on the same thread between steps, so a reserved core would
  sit idle. `engine_threads` therefore uses all cores of the process's affinity; on a shared or
  oversubscribed host set OMP_NUM_THREADS or EngineConfig.worker_threads.
- Decode attention issues one small op per sequence and layer (a context of a few hundred keys:
  ~1 MFLOP). Splitting such an op over threads buys little and costs a fork/join each time;
  `single_threaded()` runs such a loop on the calling thread only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

OMP_WAIT_POLICY_DEFAULT = "PASSIVE"


def configure_openmp_env(environ: dict[str, str] | None = None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user set it or torch (hence libgomp, which reads it
    once at load) is already imported. Returns whether it set it."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "torch" in sys.modules:
        return False
    env["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY_DEFAULT
    return True


def engine_threads(worker_threads: int = 0, cpu_count: int | None = None,
                   environ: dict[str, str] | None = None) -> int:
    """torch intra-op threads of an in-process engine: worker_threads when > 0, else
    OMP_NUM_THREADS when set, else every core this process may run on."""
    if worker_threads > 0:
        return worker_threads
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    n = cpu_count if cpu_count is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    return max(1, n)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block's torch ops on n intra-op threads, then restore the calling thread's count
    (~0.2 us each way), so an engine built in a user's process leaves the rest of it alone."""
    import torch

    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded() -> contextlib.AbstractContextManager[None]:
    """Run the block's torch ops with one intra-op thread, then restore the count."""
    return intra_op_threads(1)
