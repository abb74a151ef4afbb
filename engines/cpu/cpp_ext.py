"""Building the engine's C++ CPU kernels (one module: engines/cpu/kernels.py).

The module is compiled once per machine with torch.utils.cpp_extension (gcc, -O3 -march=native,
OpenMP, so loops run on torch's intra-op threads) into torch's extension directory
(~/.cache/torch_extensions), under a name that includes the CPU's model and flags, the compiler
flags, the torch version, the environment and a digest of the source: a -march=native binary must
never load on another CPU, and two venvs or checkouts sharing one name would rebuild each other's
copy at every first load. Because the name says all that, a later start imports the built library
directly (load_built) instead of running torch's builder again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time

import torch

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BINDING_HEADER = "#include <torch/csrc/utils/pybind.h>"
"""What the bindings need (pybind11, torch's Tensor casters, Python.h). The sources include
<torch/types.h> (ATen and torch:: tensors and factories), not <torch/extension.h>, which load_inline
adds by default: that is the whole C++ frontend (torch/all.h: nn, optim, data, jit, serialize) and
torch/python.h, most of a build's compile time, none of it used here."""


def build_name(prefix: str, source: str = "") -> str:
    """`prefix` + a digest of the machine, CPU model and flags, torch version, interpreter prefix and
    the source: two checkouts sharing one venv (or a checkout before and after a change) then build and
    load each its own copy instead of rebuilding one another's at every first load."""
    ident = platform.machine() + torch.__version__ + sys.prefix + " ".join(CFLAGS + LDFLAGS) + source
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


STALE_LOCK_S = 600
"""A build lock older than this is left by a killed process (a build takes ~25 s on 2 cores)."""


def clear_stale_lock(name: str) -> bool:
    """Remove the build lock of extension `name` when it is older than STALE_LOCK_S; whether it did.

    torch's builder takes a lock file in the extension's directory for every load, built or not, and
    waits for it forever: a process killed while it held the lock (Ctrl-C or a timeout during the
    first start) left every later engine start hanging at load (seen here: a CI run waited 9 min)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:  # no lock: nothing to clear
        return False
    if age <= STALE_LOCK_S:
        return False
    log.warning("removing a stale build lock %s (%.0f s old, left by a process that was stopped mid-build)",
                lock, age)
    try:
        os.remove(lock)
    except OSError:
        return False
    return True


def bindings(functions: list[str], namespaces: tuple[str, ...] = ()) -> str:
    """The module's Python bindings of `functions`, each called with the GIL released (as torch's own
    ops are): a kernel bound as load_inline's `functions=` would hold it for its whole run, and the
    serving process's event loop (HTTP, streaming, new requests) then stalls for each engine step
    that runs one (a whole fused decode step: BENCHMARKS.md, issue 15). The functions take and
    return tensors and plain values only, and their shared state has its own locks. `namespaces`:
    where else the functions are looked up (engines/cpu/kernels.py: each kernel's source in its own)."""
    uses = "".join(f"  using namespace {ns};\n" for ns in namespaces)
    defs = "".join(f'  m.def("{f}", &{f}, "{f}", py::call_guard<py::gil_scoped_release>());\n' for f in functions)
    return f"\n{BINDING_HEADER}\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{uses}{defs}}}\n"


def load_built(name: str) -> object | None:
    """The module `name` imported straight from its build directory when a finished build is there
    (ninja logged the link of `name`.so) and nobody holds the build lock; None otherwise.

    torch's load_inline does more at every load: it takes the build lock and runs ninja to check
    that the library is up to date, ~0.1-0.5 s a module on an idle host (more on a busy one) and a
    wait on any lock left behind. The name already holds a digest of the source, the flags, the
    torch build, the interpreter and the CPU (build_name): a library of that name is the one this
    source builds here, so its presence is the check. A build cut off mid-way has no log line for
    the link (ninja writes it after the command succeeds) and an import error falls back to
    load_inline, which builds it again."""
    from torch.utils.cpp_extension import _get_build_directory

    d = _get_build_directory(name, verbose=False)
    lib = os.path.join(d, f"{name}.so")
    if os.path.exists(os.path.join(d, "lock")) or not os.path.exists(lib):
        return None
    try:
        with open(os.path.join(d, ".ninja_log")) as f:
            linked = any(ln.rstrip("\n").split("\t")[3:4] == [f"{name}.so"] for ln in f)
    except OSError:
        return None
    if not linked:
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, lib)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as exc:
        log.warning("%s: the built library did not load (%s); building it again", name, exc)
        return None
    return mod


def build(prefix: str, source: str, functions: list[str], what: str, namespaces: tuple[str, ...] = ()
          ) -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable): no compiler, no ninja or a build
    error all mean "not on this machine"; the caller decides whether that is an error."""
    try:
        from torch.utils.cpp_extension import load_inline

        name = build_name(prefix, source)
        clear_stale_lock(name)
        t = time.perf_counter()
        mod = load_built(name)
        if mod is None:
            find_ninja()
            mod = load_inline(name=name, cpp_sources=source + bindings(functions, namespaces), functions=None,
                              extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False,
                              no_implicit_headers=True)
        why = f"{what} ready in {time.perf_counter() - t:.1f} s"
        log.info(why)
        return mod, why
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        why = f"{what} unavailable ({type(exc).__name__}: {str(exc)[-300:]})"
        log.warning(why)
        return None, why
