"""Build the engine's three C++ CPU modules at once, one compiler per module, instead of one after
another at first use.

    python -m engines.cpu.prebuild        # what `make setup` runs: the once-per-machine step

Each module (panel Linears + FP8, paged attention, the fused decode step) is one g++ run of ~25-40 s
on a 2-core host, mostly torch's headers; built lazily they came one after the other inside the first
`make serve` (about 100 s of a cold start). The builds are separate processes (ninja, g++), so threads
that wait on them run them side by side. The engine calls `start()` when it builds a CPU runner, so a
start on a machine that never ran `make setup` builds them while it loads the weights; every
`load()` keeps its own cache and lock, so a later call returns the built module (or why it is
unavailable) whatever finished first.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from engines.cpu import fused_decode, paged_kernel, panel_kernel

LOADERS = {"panel": panel_kernel.load, "paged": paged_kernel.load, "fused": fused_decode.load}
"""Each module's cached loader: (module or None, why)."""

_started = threading.Event()


def build_all() -> dict[str, str]:
    """Build (or load) every module in parallel; {name: why} (ready in N s / unavailable: reason)."""
    with ThreadPoolExecutor(max_workers=len(LOADERS), thread_name_prefix="cpp-build") as pool:
        futures = {name: pool.submit(fn) for name, fn in LOADERS.items()}
        return {name: f.result()[1] for name, f in futures.items()}


def start() -> None:
    """Start build_all() in the background once per process; each kernel's first use waits on its own
    load(). The process waits for the builds at exit: a build cut off mid-way leaves torch's build
    lock behind, and every later start on the machine would wait on it (cpp_ext.clear_stale_lock)."""
    if not _started.is_set():
        _started.set()
        thread = threading.Thread(target=build_all, name="cpp-prebuild", daemon=True)
        thread.start()
        atexit.register(thread.join)


def main() -> int:
    t = time.perf_counter()
    print("building the CPU kernels (once per machine) ...", flush=True)
    results = build_all()
    for name, why in results.items():
        print(f"  {name}: {why}")
    print(f"done in {time.perf_counter() - t:.1f} s")
    return 0  # a kernel a host cannot build is not an error: the engine runs torch's kernels there


if __name__ == "__main__":
    sys.exit(main())
