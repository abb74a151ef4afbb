"""The engine's C++ CPU kernels as one module: the panel Linear and FP8 kernels, the paged-attention
kernel and the fused decode step, compiled as one translation unit.

The fused decode step calls the other kernels, so its source already holds all of them, each in a
namespace of its own (engines/cpu/fused_decode.combined_source). Built as three modules, that code
was compiled twice and torch's headers three times (~140 s of g++ CPU a machine against ~55 s as
one; a CI run builds them in `make setup`). This module binds every kernel's functions, and
engines/cpu/panel_kernel.py, paged_kernel.py and fused_decode.py `load()` all return it: built once
per machine (engines/cpu/cpp_ext.py), by `make setup` (engines/cpu/prebuild.py) or at the first
engine start, then imported in a fraction of a second.
"""

from __future__ import annotations

import functools

from engines.cpu.cpp_ext import build

NAMESPACES = ("panel_src", "fp8_src", "paged_src")
"""The namespaces fused_decode.combined_source puts the kernels' sources in; the bindings look their
functions up there (the fused step's own functions are at namespace scope)."""


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable); built on first use (~40-60 s on 2 cores)."""
    from engines.cpu import fused_decode, paged_kernel, panel_kernel

    functions = [*panel_kernel.FUNCTIONS, *paged_kernel.FUNCTIONS, *fused_decode.FUNCTIONS]
    return build("shardserve_cpu_", fused_decode.combined_source(), functions,
                 "CPU kernels (panel, FP8, paged attention, fused decode step)", NAMESPACES)
