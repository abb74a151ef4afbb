"""The engine's C++ CPU kernels as one module: the panel Linear and FP8 kernels, the paged-attention
kernel and the fused decode step, compiled as one translation unit.

The fused decode step calls the other kernels, so its source holds all of them, each in a namespace
of its own (`combined_source`). Built as three modules, that code
was compiled twice and torch's headers three times (~140 s of g++ CPU a machine against ~55 s as
one; a CI run builds them in `make setup`). This module binds every kernel's functions, and
engines/cpu/panel_kernel.py, paged_kernel.py and fused_decode.py `load()` all return it: built once
per machine (engines/cpu/cpp_ext.py), by `make setup` (engines/cpu/prebuild.py) or at the first
engine start, then imported in a fraction of a second.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

from engines.cpu.cpp_ext import build

CSRC = Path(__file__).parent / "csrc"
"""The C++ sources beside this package (package data of the installed package)."""

SOURCES = (("panel_src", "panel_amx.cpp"), ("panel_src", "panel_rows.cpp"), ("panel_src", "panel_kernel.cpp"),
           ("fp8_src", "fp8_panel_kernel.cpp"), ("fp8_src", "fp8_range.cpp"),
           ("paged_src", "paged_kernel.cpp"), ("paged_src", "paged_avx2.cpp"), ("paged_src", "paged_attend.cpp"),
           ("paged_src", "paged_cascade.cpp"), ("paged_src", "paged_causal.cpp"), ("paged_src", "paged_decode.cpp"))
"""Each kernel's namespace in the combined source and its file (a namespace may take several, in order); the fused
step (fused_decode.cpp) comes last, at namespace scope, and calls into them."""

LOOP = ("mlp_rows.cpp", "fused_decode.cpp", "team_linear.cpp", "fused_team.cpp", "head_screen.cpp", "fused_steps.cpp")
"""The fused step's sources, last, at namespace scope: the MLP's activation rows, the per-op loop, then the step as one
parallel region (its Linears' claims, then the team), the greedy screen's candidate rows (engines/cpu/greedy_head.py),
and several greedy steps a call."""

NAMESPACES = tuple(dict.fromkeys(ns for ns, _ in SOURCES))
"""The namespaces the bindings look the kernels' functions up in."""

FUNCTIONS = [
    "pack_panels", "panel_linear", "panel_linear_res", "panel_linear_f32", "panel_variant",  # panel_kernel.cpp
    "panel_auto_variant",
    "fp8_pack_panels", "fp8_linear", "fp8_linear_f32", "fp8_variant",     # fp8_range.cpp
    "paged_decode", "cascade_prefill", "causal_prefill",                  # paged_decode.cpp
    "decode_blocks", "bind", "unbind", "decode_bound", "decode_half_bound",  # fused_decode.cpp
    "decode_steps_bound",                                                 # fused_steps.cpp
    "write_slots", "rope_inplace", "rms_norm_rows", "swiglu_rows_",       # fused_decode.cpp: module path
    "argmax_rows", "argmax_rows_variant", "near_max_rows",                # fused_decode.cpp: greedy
    "panel_swiglu", "panel_gelu", "gelu_tanh_rows",                       # mlp_rows.cpp
]
"""Every bound function of the module (engines/cpu/panel_kernel.py, paged_kernel.py and fused_decode.py
call them)."""

_INCLUDE = re.compile(r"^#include [<\"].*[>\"]$", flags=re.MULTILINE)


def _split(source: str) -> tuple[list[str], str]:
    """(its #include lines, the rest): the includes go to the top of the combined source, the rest
    into a namespace (an #include inside a namespace would put the library in it)."""
    return _INCLUDE.findall(source), _INCLUDE.sub("", source)


def combined_source() -> str:
    """The kernels' sources, each in its namespace, then the fused step (LOOP)."""
    parts, includes = [], []
    loop_inc, loop = _split("".join((CSRC / f).read_text() for f in LOOP))
    for name, filename in SOURCES:
        inc, body = _split((CSRC / filename).read_text())
        includes += [i for i in inc if i not in includes and "immintrin" not in i]
        parts.append(f"namespace {name} {{\n{body}\n}}  // namespace {name}\n")
    includes += [i for i in loop_inc if i not in includes]
    # immintrin.h on x86 (the panel and FP8 kernels' own guards, kept in their bodies, are now empty)
    head = "\n".join(includes) + "\n#if defined(__x86_64__)\n#include <immintrin.h>\n#endif\n"
    return head + "".join(parts) + loop


_LOADING = threading.Lock()
"""One thread of a process imports the module at a time: the engine's background prebuild (prebuild.start) and
the weights' first kernel call both miss load()'s cache at start, and two threads running an extension's init at
once gave one of them the module before its functions were bound ("no attribute 'pack_panels'", a shard worker
at start under load); the second caller now waits and imports the finished module."""


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable); built on first use (~40-60 s on 2 cores)."""
    with _LOADING:
        return build("shardserve_cpu_", combined_source(), FUNCTIONS,
                     "CPU kernels (panel, FP8, paged attention, fused decode step)", NAMESPACES)
