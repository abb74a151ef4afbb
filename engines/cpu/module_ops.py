"""The module path's cache write, rotary embedding, RMSNorm and SwiGLU through the C++ kernels, on CPU at
inference.

A prefill chunk of 1,024 tokens (SmolLM2-135M, bf16, one thread of the Xeon of BENCHMARKS.md) spent
~490 ms, of which the Linears took ~185: `index_copy_` into the KV cache ~1 ms a call (60 a chunk)
and the rotary embedding's eleven ops a tensor (fp32 copies, products, the concatenation, the
rounding back) and RMSNorm's five (widening, statistics, rounding, the weight's product) much of
the rest. The fused decode step (csrc/fused_decode.cpp) does each in a loop, the first two with
torch's arithmetic (one memcpy a row; rotate-half in fp32 with no fused multiply-add, so the same
bits as apply_rope), RMSNorm in one pass a row (fp32 statistics summed in SIMD lanes: within an ulp
of at::rms_norm's, the same bits in both paths); here the module path calls the same loops, split by
rows over torch's threads: that chunk took ~445 ms. They apply on CPU with grad off (the engine's inference mode): training,
autograd and other devices keep the torch ops. Where the kernels cannot be built, the torch ops run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _module():
    from engines.cpu import kernels

    mod, _ = kernels.load()
    return mod


def applies(x: torch.Tensor) -> bool:
    """Whether x's step may take the kernels: a CPU tensor of fp32 / bf16 / fp16 with grad off, outside
    torch.compile's tracing (a compiled graph keeps torch's ops)."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled() and not x.requires_grad
            and not torch.compiler.is_compiling()
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _module() is not None)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x (B, T, heads, hd) in place (B * T rows mergeable, hd adjacent) by cos / sin (B, T, hd / 2)
    fp32, as transformer.apply_rope computes it. False (x untouched) where the kernel does not apply."""
    if not applies(x) or x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1) or cos.dtype != torch.float32:
        return False
    rows = x.shape[0] * x.shape[1]
    _module().rope_inplace(x.view(rows, x.shape[2], x.shape[3]), cos.reshape(rows, -1).contiguous(),
                           sin.reshape(rows, -1).contiguous())
    return True


def write_slots(cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """cache[slots] = src (cache (slots, nkv, hd), src (M, nkv, hd)): index_copy_'s result."""
    if applies(src) and src.dtype == cache.dtype:
        _module().write_slots(cache, slots, src)
    else:
        cache.index_copy_(0, slots, src)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformer.RMSNorm's steps (fp32 statistics, the product rounded to x's dtype, then times the weight)
    in one pass a row, the fused step's arithmetic; x (..., C), weight (C) of x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _module().rms_norm_rows(x, weight, eps)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h (..., 2 ffn), gate first: silu in fp32 rounded to h's dtype, then the product
    rounded (torch's steps; the exponential 16 lanes at a time, within ~2e-7 of torch's), one pass a row."""
    ffn = h.shape[-1] // 2
    rows = h.reshape(-1, 2 * ffn)
    return _module().swiglu_rows_(rows, ffn).view(*h.shape[:-1], ffn)


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GELU in its tanh form of h (..., N) fp32 / bf16 (csrc/mlp_rows.cpp gelu_span: x sigmoid(2u) from one
    exponential, within ~2e-7 |x| of the exact function; torch's tanh from Sleef took ~10 cycles an element, ~8 % of a
    GPT-2 decode step of 60 rows), as a new tensor (h may be what a forward hook kept); other dtypes: torch's."""
    if h.dtype not in (torch.float32, torch.bfloat16):
        return F.gelu(h, approximate="tanh")
    return _module().gelu_tanh_rows(h.reshape(-1, h.shape[-1])).view(h.shape)


def _panel_code(layer: torch.nn.Module, rows: int) -> int | None:
    """The panel kernel's variant code (panel_kernel.PANEL_VARIANTS) of a FastLinear's kernel for `rows` rows where it
    is one of the panel kinds (fast_linear.PANEL_KINDS), else None."""
    from engines.cpu.fast_linear import PANEL_KINDS
    from engines.cpu.panel_kernel import PANEL_VARIANTS

    kind = layer.kind_for(rows)
    return PANEL_VARIANTS[PANEL_KINDS[kind]] if kind in PANEL_KINDS else None


def linear_gelu(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(layer(x)) for an MLP's up Linear: where layer is a FastLinear (no hooks) whose kernel for x's rows is
    a panel one, through panel_gelu (a prefill chunk on AVX2: the activation in the kernel's store, the (M, N) output
    written once; the same bits); else the Linear, then gelu_tanh."""
    from engines.cpu.fast_linear import FastLinear

    if (isinstance(layer, FastLinear) and not layer._forward_hooks and layer.panels is not None
            and x.dtype in (torch.float32, torch.bfloat16)):
        x2 = x.reshape(-1, layer.in_features)  # (M, in)
        if (code := _panel_code(layer, x2.shape[0])) is not None:
            out = _module().panel_gelu(x2.contiguous(), layer.panels, layer.out_features, layer.bias, code)
            return out.view(*x.shape[:-1], layer.out_features)
    return gelu_tanh(layer(x))


def linear_add(layer: torch.nn.Module, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """res + layer(x) (a block's output projection added to the residual stream), rounded as that sum rounds: where
    layer is a FastLinear (no hooks) whose kernel for x's rows is a panel one, in the kernel's store (the torch add
    read both (M, C) tensors and wrote a third: 368 adds of ~0.65 ms in SmolLM2's fp32 prefill of 8.7k tokens on 2
    Zen 3 cores); else the torch add. res (..., out) of x's dtype."""
    from engines.cpu.fast_linear import FastLinear

    if (isinstance(layer, FastLinear) and applies(x) and not layer._forward_hooks and layer.panels is not None
            and res.dtype == x.dtype and res.is_contiguous()):
        x2 = x.reshape(-1, layer.in_features)  # (M, in)
        if (code := _panel_code(layer, x2.shape[0])) is not None:
            return _module().panel_linear_res(x2.contiguous(), layer.panels, layer.out_features, layer.bias,
                                              res.reshape(-1, layer.out_features), code).view(res.shape)
    return res + layer(x)


def linear_swiglu(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """swiglu(layer(x)) for a SwiGLU MLP's fused gate / up Linear (2 ffn outputs, gate first): where layer is a
    FastLinear (no hooks, no bias) whose kernel for x's rows is a panel one, SwiGLU in the kernel's store on a
    prefill chunk (csrc/mlp_rows.cpp panel_swiglu: the (M, 2 ffn) product, 25 MB a layer for SmolLM2's 2,048 fp32
    rows, is never written nor read back; the same bits); else the Linear, then swiglu."""
    from engines.cpu.fast_linear import FastLinear

    if (isinstance(layer, FastLinear) and not layer._forward_hooks and layer.panels is not None and layer.bias is None
            and layer.out_features % 2 == 0):
        x2 = x.reshape(-1, layer.in_features)  # (M, in)
        if (code := _panel_code(layer, x2.shape[0])) is not None:
            out = _module().panel_swiglu(x2.contiguous(), layer.panels, layer.out_features // 2, code)
            return out.view(*x.shape[:-1], layer.out_features // 2)
    return swiglu(layer(x))
