"""A runtime transformation for CPU inference: each Linear gets the faster of two weight layouts.

On CPU, a matrix-vector product (decode at small batch) is memory-bound, and the BLAS kernels
behind `F.linear` (weight stored (out, in)) and `torch.mm` with a pre-transposed weight
(stored (in, out)) stream memory at very different rates depending on the build, the dtype and
the shape: measured here, up to 3x apart for fp32 at batch 1. So each distinct
(out, in, dtype) shape is timed once, both ways, at load, and the faster layout is kept.
The model file stays plain; this only swaps modules of exact type nn.Linear (a parallel layer
that subclasses Linear keeps its own forward).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class PretransposedLinear(nn.Module):
    """y = x @ W^T + b computed as addmm(b, x, Wt) with Wt = W^T stored contiguous (in, out)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        y = torch.mm(x2, self.weight_t) if self.bias is None else torch.addmm(self.bias, x2, self.weight_t)
        return y.view(*x.shape[:-1], self.out_features)


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pretransposed_is_faster(out_f: int, in_f: int, dtype: torch.dtype, batch: int = 1, reps: int = 7) -> bool:
    """Time both layouts for a (batch, in) x (in, out) product, interleaved; True if mm wins by 10%."""
    w = torch.randn(out_f, in_f).to(dtype)
    wt = w.t().contiguous()
    x = torch.randn(batch, in_f).to(dtype)
    lin = mm = float("inf")
    for _ in range(3):  # interleave so that a noisy neighbour hurts both alike
        lin = min(lin, _time(lambda: F.linear(x, w), reps))
        mm = min(mm, _time(lambda: torch.mm(x, wt), reps))
    return mm < 0.9 * lin


def apply_fast_linear(model: nn.Module, batch: int = 1) -> dict[tuple[int, int], bool]:
    """Swap each plain nn.Linear whose shape decodes faster pre-transposed; returns the choices."""
    choices: dict[tuple[int, int], bool] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            key = (child.out_features, child.in_features)
            if key not in choices:
                choices[key] = pretransposed_is_faster(*key, child.weight.dtype, batch)
            if choices[key]:
                setattr(parent, name, PretransposedLinear(child))
    return choices
