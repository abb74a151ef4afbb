"""An FP8 weight-only Linear on CPU that keeps one byte a weight (engines/cpu/panel_kernel.py's FP8 kernel); split
from engines/cpu/fast_linear.py, whose row-count threshold it shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.cpu import panel_kernel
from engines.cpu.fast_linear import BULK_FROM


@torch.library.custom_op("shardserve::fp8_panel_linear", mutates_args=())
def fp8_panel_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None, variant: str) -> torch.Tensor:
    """panel_kernel.fp8_linear as an operator a compiled decode step (fullgraph) calls as it is, instead of
    tracing into the kernel's loader."""
    return panel_kernel.fp8_linear(x, panels, scales, out_features, bias, variant)


@fp8_panel_linear.register_fake
def _(x, panels, scales, out_features, bias, variant):
    return x.new_empty(x.shape[0], out_features)


class Fp8PanelLinear(nn.Module):
    """An FP8 weight-only Linear on CPU that keeps one byte a weight: the e4m3 weight in panels, widened in
    registers by engines/panel_kernel.fp8_linear (per-output scales and the bias applied in the kernel)
    for decode-sized row counts; a prefill chunk (BULK_FROM rows or more) dequantizes to x's dtype and
    runs F.linear (compute-bound there: the dequantized copy is per call, never kept).

    Built from an engines.transforms.fp8.Fp8Linear that is not a tensor-parallel shard (`from_fp8`); engines.transforms.fp8.apply_fp8
    swaps a CPU model's such layers for these instead of dequantizing them at load."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 variant: str = "auto"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.variant = variant
        self.register_buffer("panels", panel_kernel.fp8_pack_panels(weight), persistent=False)  # (P, in / 2, 32) uint8
        self.register_buffer("scales", weight_scale.detach().float().reshape(-1).contiguous(), persistent=False)
        self.bias = bias

    @classmethod
    def from_fp8(cls, mod: nn.Module, dtype: torch.dtype, variant: str = "auto") -> Fp8PanelLinear:
        """From an engines.transforms.fp8.Fp8Linear (e4m3 weight (out, in), fp32 weight_scale (out, 1)); bias in `dtype`."""
        if getattr(mod, "comm", None) is not None:
            raise ValueError("Fp8PanelLinear: a tensor-parallel shard all-reduces its output; not handled here")
        bias = mod.bias.detach().to(dtype) if mod.bias is not None else None
        return cls(mod.weight.detach(), mod.weight_scale.detach(), bias, variant)

    def weight_fp8(self) -> torch.Tensor:
        """The (out, in) e4m3 weight, unpacked from the panels (for the prefill path and checks)."""
        return panel_kernel.fp8_unpack_panels(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x2.shape[0] >= BULK_FROM:
            w = (self.weight_fp8().float() * self.scales[:, None]).to(x.dtype)
            y = F.linear(x2, w, self.bias)
        elif torch.compiler.is_compiling():  # eager skips the operator's dispatch (~200 calls a decode step)
            y = fp8_panel_linear(x2, self.panels, self.scales, self.out_features, self.bias, self.variant)
        else:
            y = panel_kernel.fp8_linear(x2, self.panels, self.scales, self.out_features, self.bias, self.variant)
        return y.view(*x.shape[:-1], self.out_features)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The output in fp32 (a vocabulary head's logits, engines/model/transformer.head_logits): for decode-sized
        row counts the kernel's fp32 sums unrounded (rounded to bf16, near-equal logits become equal, and greedy takes
        the lower id: FastLinear.forward_float's reason), with no second pass to widen them; otherwise forward's."""
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= BULK_FROM or torch.compiler.is_compiling() or torch.is_grad_enabled():
            return self.forward(x).float()
        y = panel_kernel.fp8_linear(x2, self.panels, self.scales, self.out_features, self.bias, self.variant,
                                    out_float=True)
        return y.view(*x.shape[:-1], self.out_features)
