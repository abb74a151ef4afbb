"""Building the engine's small C++ CPU kernels (engines/paged_kernel.py, engines/panel_kernel.py).

Each is compiled once per machine with torch.utils.cpp_extension (gcc, -O3 -march=native, OpenMP,
so loops run on torch's intra-op threads) into torch's extension directory
(~/.cache/torch_extensions), under a name that includes the CPU's model and flags, the torch
version and the environment: a -march=native binary must never load on another CPU, and two
venvs sharing one name would rebuild each other's copy at every first load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time

import torch

log = logging.getLogger(__name__)


def build_name(prefix: str) -> str:
    """`prefix` + a digest of the machine, CPU model and flags, torch version and interpreter prefix."""
    ident = platform.machine() + torch.__version__ + sys.prefix
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        ident += "".join(lines)
    except OSError:
        pass
    return prefix + hashlib.sha1(ident.encode()).hexdigest()[:12]


def find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it beside this
    interpreter, which is not on PATH when the venv is not activated (make serve, Ray workers)."""
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def build(prefix: str, source: str, functions: list[str], what: str) -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable): no compiler, no ninja or a build
    error all mean "not on this machine"; the caller decides whether that is an error."""
    try:
        from torch.utils.cpp_extension import load_inline

        find_ninja()
        t = time.perf_counter()
        mod = load_inline(name=build_name(prefix), cpp_sources=source, functions=functions,
                          extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)
        why = f"{what} ready in {time.perf_counter() - t:.1f} s"
        log.info(why)
        return mod, why
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        why = f"{what} unavailable ({type(exc).__name__}: {str(exc)[-300:]})"
        log.warning(why)
        return None, why
