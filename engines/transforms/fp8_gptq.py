"""GPTQ-style error compensation for FP8 weights: the same file format, smaller output error.

Round-to-nearest (fp8_format.quantize_rows) rounds every weight on its own. GPTQ (Frantar et al.,
2022) rounds the input columns of a Linear one at a time and moves each column's rounding error
onto the columns not yet rounded, weighted by the inverse Hessian H = X^T X of the layer's inputs
X (tokens, in) seen on calibration text, so that ||X W^T - X Q^T|| is small rather than
||W - Q||. Here the grid is e4m3 with the per-output-channel scale absmax(row) / 448 fixed
beforehand (the scale rows of the compressed-tensors file are unchanged; only which e4m3 code each
weight gets differs), so whatever reads the RTN file reads this one.

Columns are visited in order of decreasing H diagonal (GPTQ's act-order: the inputs that carry
the most energy are rounded first, while the most columns remain to absorb their error); with one
scale per output channel the order leaves no trace in the file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, Fp8FormatError, quantize_rows

DAMP = 0.01
"""Fraction of the mean H diagonal added to the diagonal before inverting (GPTQ's percdamp)."""
BLOCK = 128
"""Columns rounded per lazy-update block (the result does not depend on it; the speed does)."""


def gptq_rows(w: torch.Tensor, h: torch.Tensor, damp: float = DAMP, block: int = BLOCK,
              name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float, h (in, in) = sum of x x^T over calibration inputs -> (e4m3 (out, in), fp32
    scale (out, 1)), the scale being quantize_rows' (absmax / 448 per row)."""
    _, scale = quantize_rows(w, name)  # also checks the shape and finiteness
    n_in = w.shape[1]
    if tuple(h.shape) != (n_in, n_in):
        raise Fp8FormatError(f"{name}: Hessian shape {tuple(h.shape)} does not match {n_in} input features")
    W = w.detach().float().clone()  # (out, in), updated in place as columns are rounded
    H = h.detach().float().clone()
    dead = torch.diag(H) == 0  # inputs never active in calibration: nothing to compensate
    H[dead, dead] = 1.0
    W[:, dead] = w.detach().float()[:, dead]
    perm = torch.argsort(torch.diag(H), descending=True)
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    # upper Cholesky factor of H^-1: row i holds the update weights for the columns after i
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty_like(W, dtype=FP8_DTYPE)  # (out, in) in the permuted order
    s = scale  # (out, 1)
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        W1, H1 = W[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = W1[:, i:i + 1]  # (out, 1)
            c = (col / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            codes[:, i1 + i:i1 + i + 1] = c
            e = (col - c.float() * s) / H1[i, i]
            W1[:, i:] -= e * H1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes[:, torch.argsort(perm)].contiguous(), scale


def input_hessians(model: torch.nn.Module, windows: torch.Tensor, names: set[str], batch: int = 4
                   ) -> dict[str, torch.Tensor]:
    """sum over calibration tokens of x x^T (in, in), fp32, for the input x of each Linear in `names`,
    from one pass of `model` over `windows` (n, T) token ids."""
    hs: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (tokens, in)
            hs[name] = hs[name].addmm_(x.t(), x) if name in hs else x.t() @ x
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if n in names]
    try:
        with torch.inference_mode():
            for i in range(0, len(windows), batch):
                model(windows[i:i + batch])
    finally:
        for h in handles:
            h.remove()
    missing = names - hs.keys()
    if missing:
        raise ValueError(f"calibration: no input reached {sorted(missing)[:3]}")
    return hs


def gptq_quantize(model: torch.nn.Module, windows: torch.Tensor, keep: frozenset[str] = frozenset(),
                  on_layer: Callable[[str], None] | None = None) -> int:
    """Replace the block Linears of `model` (float) by engines.transforms.fp8.Fp8Linear holding GPTQ
    codes, the Hessians taken from one pass of the float model over `windows` (n, T) token ids of
    calibration text; layers named in `keep` stay float. save_checkpoint writes the result as a
    standard FP8 file. `on_layer(name)` is called as each layer is done (a progress bar). Returns how
    many layers were quantized."""
    from engines.transforms.fp8 import BLOCK_LINEARS, Fp8Linear

    names = {n for n, m in model.named_modules() if n.endswith(BLOCK_LINEARS) and n not in keep
             and isinstance(m, torch.nn.Linear)}
    hs = input_hessians(model, windows, names)
    # the column loop runs thousands of ops on (out, <=128) slices: waking a thread team for each costs
    # more than it saves (SmolLM2-135M on a loaded 2-core host: 154 s on one thread, >15 min on two)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in sorted(names):
            lin = model.get_submodule(name)
            fp8 = Fp8Linear.quantize(lin, getattr(lin, "comm", None))
            fp8.weight.data, fp8.weight_scale.data = gptq_rows(lin.weight, hs.pop(name), name=name)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, fp8)
            if on_layer is not None:
                on_layer(name)
    finally:
        torch.set_num_threads(threads)
    return len(names)


def gptq_head(model: torch.nn.Module, windows: torch.Tensor, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ e4m3 codes (V, C) and per-row scales (V, 1) of `model`'s LM head (float), the Hessian taken from
    the final hidden states (the head's input) of one pass over `windows` (n, T) token ids. Run after
    gptq_quantize: the pass then goes through the blocks' FP8 codes, as a served model does. The head stays
    in the model as it is (a tied head is the embedding): the codes are for EngineConfig.lm_head_dtype fp8."""
    h = None
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            x = model(windows[i:i + batch]).detach().float()
            x = x.reshape(-1, x.shape[-1])  # (tokens, C)
            h = x.t() @ x if h is None else h.addmm_(x.t(), x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see gptq_quantize
    try:
        return gptq_rows(model.lm_head.weight, h, name="lm_head.weight")
    finally:
        torch.set_num_threads(threads)


def calibration_windows(ids: list[int], n: int, length: int) -> torch.Tensor:
    """(n', length) token ids: up to `n` windows spread evenly over `ids` (a tokenized calibration
    text), so a long text is sampled from end to end rather than only its start."""
    if n < 1 or length < 2:
        raise ValueError(f"calibration: need n >= 1 windows of length >= 2, got n={n}, length={length}")
    fit = len(ids) // length
    if fit == 0:
        raise ValueError(f"calibration: the text holds {len(ids)} tokens, fewer than one window of {length}")
    n = min(n, fit)
    stride = (len(ids) - length) // max(n - 1, 1)
    return torch.tensor([ids[i * stride:i * stride + length] for i in range(n)], dtype=torch.long)
