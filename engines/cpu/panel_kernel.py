"""A CPU Linear kernel for the few rows of a decode step: y = x @ W^T + b on a weight stored in panels.

At 1-32 rows a Linear is neither one matrix-vector product nor a big GEMM, and the kernels torch
ships are tuned for the two ends: on the 2-core EPYC of BENCHMARKS.md (issue 12) oneDNN's
prepacked fp32 kernel ran GPT-2-124M's decode Linears at 14 GB/s for one row (the machine streams
35) and at ~100 GFLOP/s for 16 rows (the fp32 peak is ~190). Here the weight (N, K) is stored once
as panels (ceil(N / 16), K, 16): 16 output features side by side for each input feature, so a
panel is one sequential read. One task per panel on torch's intra-op threads keeps up to 16 rows x
16 outputs of fp32 sums in vector registers, and for each input feature loads 16 weights once and
multiplies them by each row's value (the rows are transposed first, so those values are adjacent).
More rows run in blocks of 16 over the same panel while it is in cache.

A bf16 weight is stored as pairs of inputs per output lane, (ceil(N / 16), ceil(K / 2), 16, 2): where
the CPU has AVX512-BF16 one vdpbf16ps multiplies a lane's pair by the row's pair and adds both to
the fp32 sum (twice the products of an fp32 FMA per instruction; oneDNN's bf16 kernel does the
same); elsewhere both halves are widened (a bf16 is the high half of an fp32) and multiplied in
fp32 (on an AVX2 host without AVX-512 the rows run AVX2 + FMA intrinsics chosen at run time, PANEL_VARIANTS: GCC's
64-byte vector code went through the stack there; several bf16 rows are widened to fp32 pairs first, so a row's pair
is two broadcasts; a prefill chunk, 48 rows or more, is read as it lies, untransposed, in chunks of rows that stay in
L2 through 16 KB slices of each panel that stay in L1: csrc/panel_kernel.cpp run_blocked). Where the host has AMX (AMX-TILE and AMX-BF16, Sapphire
Rapids and later), two or more bf16 rows run on the tile unit instead: the bf16 panel is the tile multiply's
weight operand as it lies, 16 rows at a time its other operand, and one instruction adds 16 rows x 16 outputs x
32 inputs (32 rows of SmolLM2's 3072 x 576 on 2 threads: 0.19 ms against 0.94 for the vector code and 0.35 for
torch's oneDNN kernel). Sums are fp32; the result is
rounded to the input's dtype. Every output element is one sequential sum over K in
order, computed by one thread: the result does not depend on the thread count. Vectors are GCC
vector extensions, so -march=native makes them AVX-512 or two AVX2 registers. Built once per
machine (engines/cpu/cpp_ext.py); engines/cpu/fast_linear.py times it against torch's kernels for each
shape and row count and uses it only where it measured faster (on a host whose "auto" runs other code, an AVX-512 or
AMX one, the avx2 variant's several-row blocks are timed as a kernel of their own: fast_linear.PANEL_KINDS).
"""

from __future__ import annotations

import contextlib
import functools

import torch

PANEL = 16
"""Output features per panel (one AVX-512 register of fp32)."""


DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the module with these kernels, why) or (None, why it is unavailable): the engine's one C++ module
    (engines/cpu/kernels.py), built on first use."""
    from engines.cpu import kernels

    return kernels.load()


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load()[0] is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> panels, a copy: fp32 (ceil(N / 16), K, 16), bf16 (ceil(N / 16), ceil(K / 2), 16, 2)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    return mod.pack_panels(weight.detach())


def unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The (out_features, in_features) weight of pack_panels' panels (a copy; the inverse of pack_panels)."""
    p = panels.shape[0]
    if panels.dim() == 3:  # fp32 (P, K, 16)
        w = panels.transpose(1, 2).reshape(p * PANEL, panels.shape[1])
    else:  # bf16 (P, K2, 16, 2)
        w = panels.permute(0, 2, 1, 3).reshape(p * PANEL, 2 * panels.shape[1])
    return w[:out_features, :in_features].contiguous()


PANEL_VARIANTS = {"auto": 0, "portable": 1, "avx2": 2, "amx": 3, "amx_emulated": 4}
"""The panel kernel's variants: "portable" the GCC vector code (AVX-512 / AVX512-BF16 where the build has them),
"avx2" AVX2 + FMA intrinsics (one row; several rows in blocks of 6 fp32 / 4 bf16 rows), the same bits; "amx" bfloat16 rows (2 or more, K a multiple of 32) as
16-row tiles through AMX's tile multiply (csrc/panel_amx.cpp amx_block; one row and fp32 as portable);
"amx_emulated" amx's tile layout with its sums in scalar C++ (any host; tests, never auto's pick); "auto"
amx where the host runs it, else avx2 on an AVX2 host whose build lacks AVX-512F, else portable. Several fp32
rows run the portable code except under avx2."""


def panel_variant(variant: str = "auto") -> str:
    """The one-row variant `variant` resolves to on this CPU; ValueError naming what the CPU lacks for a forced one."""
    if variant not in PANEL_VARIANTS:
        raise ValueError(f"panel kernel variant {variant!r}; allowed: {sorted(PANEL_VARIANTS)}")
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    try:
        code = mod.panel_variant(PANEL_VARIANTS[variant])
    except RuntimeError as exc:
        raise ValueError(str(exc).splitlines()[0]) from exc
    return {v: k for k, v in PANEL_VARIANTS.items()}[code]


@contextlib.contextmanager
def auto_pinned(variant: str):
    """Within: "auto" resolves to `variant` in this process (every kernel that takes the panel kernel's auto, the fused
    step's included). Tests: auto portable on an AVX2 host, beside Linears forced to avx2. ValueError naming what the
    CPU lacks for a variant it cannot run."""
    if variant == "auto":
        raise ValueError("auto_pinned: a variant other than auto")
    panel_variant(variant)  # an unknown one, or one this CPU lacks: ValueError
    mod = load()[0]
    before = mod.panel_auto_variant(PANEL_VARIANTS[variant])
    try:
        yield
    finally:
        mod.panel_auto_variant(before)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 variant: str = "auto") -> torch.Tensor:
    """x (M, K) through the panels of an (out_features, K) weight (+ bias) -> (M, out_features); `variant`: the
    code (PANEL_VARIANTS)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    if variant not in PANEL_VARIANTS:
        raise ValueError(f"panel kernel variant {variant!r}; allowed: {sorted(PANEL_VARIANTS)}")
    return mod.panel_linear(x, panels, out_features, bias, PANEL_VARIANTS[variant])


def panel_linear_f32(x: torch.Tensor, panels: torch.Tensor, out_features: int, variant: str = "auto") -> torch.Tensor:
    """bf16 x (M, K) through the bf16 panels of an (out_features, K) weight -> (M, out_features) fp32: the kernel's
    fp32 sums unrounded (on AMX, several rows as tiles)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    if variant not in PANEL_VARIANTS:
        raise ValueError(f"panel kernel variant {variant!r}; allowed: {sorted(PANEL_VARIANTS)}")
    return mod.panel_linear_f32(x, panels, out_features, PANEL_VARIANTS[variant])


FP8_VARIANTS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512_on_avx2": 4, "avx512bf16": 5,
                "avx512bf16_emulated": 6}
"""The FP8 kernel's variants (csrc/fp8_panel_kernel.cpp): "auto" the best this CPU runs for the rows' dtype; the
others forced (tests run each where the CPU has it; "portable" is the scalar reference and runs anywhere).
"avx512_on_avx2" is the "avx512" variant's source built for AVX2 + FMA: never chosen by "auto", it lets every
AVX2 host test the body the AVX-512 build runs. "avx512bf16" (bfloat16 rows; auto's pick for them where the CPU
has AVX512-BF16) adds a pair of inputs' products with one vdpbf16ps, flushing e4m3 subnormal weights to zero;
"avx512bf16_emulated" is its arithmetic in scalar C++, for any host."""


def load_fp8() -> tuple[object | None, str]:
    """(the module with the FP8 weight-only kernel, why) or (None, why it is unavailable): the panel module."""
    return load()


def _fp8_mod():
    mod, why = load_fp8()
    if mod is None:
        raise RuntimeError(why)
    return mod


def fp8_variant(variant: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    """The variant `variant` resolves to on this CPU for rows of `dtype`; ValueError naming what the CPU (or the
    dtype) lacks for a forced one."""
    if variant not in FP8_VARIANTS:
        raise ValueError(f"fp8 kernel variant {variant!r}; allowed: {sorted(FP8_VARIANTS)}")
    try:
        code = _fp8_mod().fp8_variant(FP8_VARIANTS[variant], dtype == torch.bfloat16)
    except RuntimeError as exc:
        raise ValueError(str(exc).splitlines()[0]) from exc
    return {v: k for k, v in FP8_VARIANTS.items()}[code]


FP8_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
"""Output of each 2-byte slot of an FP8 panel's 32-byte chunk (csrc/fp8_panel_kernel.cpp ORDER)."""


def fp8_pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) float8_e4m3fn -> panels (ceil(N / 16), ceil(K / 2), 32) of its bytes (one byte a weight):
    per pair of inputs, each of 16 outputs' two bytes side by side, outputs in FP8_ORDER."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_pack_panels: a float8_e4m3fn weight, got {weight.dtype}")
    return _fp8_mod().fp8_pack_panels(weight.detach().view(torch.uint8))


def fp8_unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The (out_features, in_features) float8_e4m3fn weight of fp8_pack_panels' panels (a copy)."""
    p, k2 = panels.shape[:2]
    slots = panels.view(p, k2, 16, 2)[:, :, list(FP8_ORDER)]  # (P, K2, 16 outputs in order, 2); an involution
    w = slots.permute(0, 2, 1, 3).reshape(p * 16, 2 * k2)[:out_features, :in_features]
    return w.contiguous().view(torch.float8_e4m3fn)


def fp8_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None, variant: str = "auto", out_float: bool = False) -> torch.Tensor:
    """x (M, K) fp32 / bf16 through FP8 panels with per-output scales (out_features,) (+ bias) -> (M, out)
    in x's dtype: what x @ (fp8 weight * scales[:, None])^T + bias computes, the bytes widened in registers.
    out_float: (M, out) fp32, the same sums unrounded (the row variant still the one x's dtype picks)."""
    fp8_variant(variant, x.dtype)  # a forced variant the CPU (or x's dtype) lacks: a clear error
    mod = _fp8_mod()
    return (mod.fp8_linear_f32 if out_float else mod.fp8_linear)(x, panels, scales.float().contiguous(), out_features,
                                                                 bias, FP8_VARIANTS[variant])
