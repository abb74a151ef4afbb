"""A runtime transformation for CPU inference: each Linear gets the fastest of three kernels.

On CPU, a matrix-vector product (decode at batch 1) is memory-bound, and the kernels behind
`F.linear` (weight stored (out, in)), `torch.mm` with a pre-transposed weight (stored (in, out))
and `torch.mv` stream memory at very different rates depending on the build, the dtype and the
shape: measured here at batch 1, bf16 `mv` reads at 86% of the fp32-sum bandwidth where
`F.linear` reaches 58%, and fp32 `F.linear` was up to 3x slower than the pre-transposed `mm` on
some shapes. So each distinct (out, in, dtype) shape is timed all three ways when the first model
with it loads in the process, and the fastest is kept. Batches of more than one row always use a
matrix-matrix kernel; a vocabulary-wide head may compute it in slices (SlicedWideLinear).
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


class GemvLinear(nn.Module):
    """F.linear, except that a single row (batch-1 decode) goes through torch.mv."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, so a tied LM head stays tied
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        x1 = x.reshape(self.in_features)
        y = torch.mv(self.weight, x1) if self.bias is None else torch.addmv(self.bias, self.weight, x1)  # (out,)
        return y.view(*x.shape[:-1], self.out_features)


class SlicedWideLinear(nn.Module):
    """A wide Linear (an LM head: tens of thousands of outputs) computed, for more than one row,
    in slices of `chunk` output features, each slice's (rows, chunk) result staying in cache; a
    single row goes to `inner` (the shape's batch-1 kernel). With MKL's fp32 GEMM on an AMD EPYC
    the (57 x 768) @ (768 x 50257) head ran ~2x faster in slices of 512-1024 than in one call, and
    slower in bf16 (oneDNN), so `choose_wide_kernel` times both on the model's own weight."""

    def __init__(self, inner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias, self.chunk = weight, bias, chunk  # weight shared (a tied head stays tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x2.shape[0] == 1:
            return self.inner(x)
        out = x2.new_empty(x2.shape[0], self.out_features)  # (M, out)
        for s in range(0, self.out_features, self.chunk):
            e = min(s + self.chunk, self.out_features)
            out[:, s:e] = F.linear(x2, self.weight[s:e], None if self.bias is None else self.bias[s:e])
        return out.view(*x.shape[:-1], self.out_features)


KERNELS = {"linear": None, "pretransposed": PretransposedLinear, "gemv": GemvLinear}
WIDE_MIN_OUT = 16384
"""Linears with at least this many outputs (vocabulary heads) also time SlicedWideLinear."""
WIDE_CHUNK, WIDE_ROWS = 1024, 32
"""Slice width, and the rows (a mid-size decode batch) both ways are timed on."""


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


_CHOSEN: dict[tuple[int, int, torch.dtype], str] = {}
"""Choices already timed in this process: every engine built here uses the same kernel for a
shape (the same rounding, hence the same tokens) and pays for the timing once."""


def fastest_kernel(out_f: int, in_f: int, dtype: torch.dtype, reps: int = 7) -> str:
    """The shape's kernel, timed on first use in the process (see `_time_kernels`)."""
    key = (out_f, in_f, dtype)
    if key not in _CHOSEN:
        _CHOSEN[key] = _time_kernels(out_f, in_f, dtype, reps)
    return _CHOSEN[key]


def _time_kernels(out_f: int, in_f: int, dtype: torch.dtype, reps: int) -> str:
    """Time the three kernels on one row, interleaved; plain linear unless another wins by 10%."""
    w = torch.randn(out_f, in_f).to(dtype)
    wt = w.t().contiguous()
    x = torch.randn(1, in_f).to(dtype)
    fns = {"linear": lambda: F.linear(x, w), "pretransposed": lambda: torch.mm(x, wt),
           "gemv": lambda: torch.mv(w, x[0])}
    best = {k: float("inf") for k in fns}
    for _ in range(3):  # interleave so that a noisy neighbour hurts all alike
        for k, fn in fns.items():
            best[k] = min(best[k], _time(fn, reps))
    winner = min(best, key=best.get)
    return winner if best[winner] < 0.9 * best["linear"] else "linear"


_WIDE_CHOSEN: dict[tuple[int, int, torch.dtype, int], bool] = {}


def choose_wide_kernel(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                       rows: int = WIDE_ROWS, reps: int = 3) -> bool:
    """Whether slices beat one call for `rows` rows of this wide Linear, timed on its own weight
    (interleaved, best of each; slices must win by 10%). Cached per shape, dtype and thread count."""
    key = (weight.shape[0], weight.shape[1], weight.dtype, torch.get_num_threads())
    if key not in _WIDE_CHOSEN:
        x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
        sliced = SlicedWideLinear(module, weight, bias, WIDE_CHUNK)
        whole = {"whole": lambda: module(x), "sliced": lambda: sliced(x)}
        best = {k: float("inf") for k in whole}
        with torch.no_grad():
            for _ in range(2):
                for k, fn in whole.items():
                    best[k] = min(best[k], _time(fn, reps))
        _WIDE_CHOSEN[key] = best["sliced"] < 0.9 * best["whole"]
    return _WIDE_CHOSEN[key]


def apply_fast_linear(model: nn.Module) -> dict[tuple[int, int], str]:
    """Swap each plain nn.Linear for its shape's fastest batch-1 kernel, and a wide one (a
    vocabulary head) for SlicedWideLinear where that times faster; returns the choices
    ("+sliced" marks the latter)."""
    choices: dict[tuple[int, int], str] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            key = (child.out_features, child.in_features)
            if key not in choices:
                choices[key] = fastest_kernel(*key, child.weight.dtype)
            kernel = KERNELS[choices[key].split("+")[0]]
            new = child if kernel is None else kernel(child)
            if child.out_features >= WIDE_MIN_OUT and choose_wide_kernel(new, child.weight, child.bias):
                new = SlicedWideLinear(new, child.weight, child.bias, WIDE_CHUNK)
                choices[key] = choices[key].split("+")[0] + "+sliced"
            if new is not child:
                setattr(parent, name, new)
    return choices
