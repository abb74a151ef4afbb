"""Build the engine's C++ CPU kernels once per machine, ahead of the first engine start.

    python -m engines.cpu.prebuild        # what `make setup` runs: the once-per-machine step

The kernels (panel Linears + FP8, paged attention, the fused decode step) are one module, one g++ run
(engines/cpu/kernels.py; ~55 s of CPU on a 2-core host, where three modules took ~140 s). The engine
calls `start()` when it builds a CPU runner, so a start on a machine that never ran `make setup`
builds it while it loads the weights; the build holds torch's lock, so a kernel's first use waits for
it and then returns the built module (or why it is unavailable).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

from engines.cpu import kernels

_started = threading.Event()


def build_all() -> dict[str, str]:
    """Build (or load) the kernels' module; {name: why} (ready in N s / unavailable: reason)."""
    return {"kernels": kernels.load()[1]}


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
