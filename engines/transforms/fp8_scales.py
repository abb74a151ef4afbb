"""Data-free FP8 scales: each output channel's scale chosen to minimise its own rounding error.

Round-to-nearest (fp8_format.quantize_rows) takes scale = absmax(row) / 448, so the row's largest weight
lands exactly on e4m3's largest code. e4m3 is a floating-point grid (3 mantissa bits: 8 steps per
binade, the step doubling each binade), so a row's squared error is dominated by its large weights, and
where those fall between codes depends on the scale. Dividing the scale by f in (0.5, 1] keeps every
weight in range (the max maps to 448 f, no clipping) and slides the whole row along the grid; f = 0.5
is the same grid as f = 1 one binade down, so the interval covers every placement. `search_rows`
tries COARSE_STEPS evenly spaced factors per row, then FINE_STEPS around each row's best, and keeps
the scale with the least sum of squared errors; the codes are that scale's nearest e4m3 values. The
file format is unchanged (e4m3 weights, one fp32 scale per output channel): only the scale values
differ, so every reader, the CPU kernels included, runs the file as before at the same speed. No
calibration data is used.

Opt-in (`shardserve quantize --scales search`), not the default: on SmolLM2-135M-Instruct it lowers
each layer's squared weight error by 11-17 % yet raises perplexity more than round-to-nearest does
(+1.889 % vs +1.155 % against bf16 on Shakespeare validation text; docs/fp8.md). Absmax scales keep each
row's largest weight exact, which the search gives up for a smaller total.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, quantize_rows

COARSE_STEPS = 16
"""Scale factors tried first per row: f = 1 - k / (2 COARSE_STEPS), k = 0..COARSE_STEPS-1, i.e. (0.5, 1]."""
FINE_STEPS = 8
"""Then FINE_STEPS factors evenly spread within one coarse step around each row's best (a finer search
for a third of the cost of trying as many factors everywhere)."""


def _row_errors(w32: torch.Tensor, inv_s: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """Sum over each row of (q - w / s)^2 (x importance), q the e4m3 nearest to w / s; in units of s^2.
    w32 (out, in) fp32, inv_s (out, 1) -> (out, 1)."""
    x = w32 * inv_s  # (out, in), |x| <= 448 since s >= absmax / 448
    d = x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float().sub_(x).square_()
    return (d.mul_(imp) if imp is not None else d).sum(1, keepdim=True)


def search_rows(w: torch.Tensor, name: str = "weight", importance: torch.Tensor | None = None,
                coarse: int = COARSE_STEPS, fine: int = FINE_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> (e4m3 (out, in), fp32 scale (out, 1)): per row, the scale absmax / (448 f),
    f in (0.5, 1], with the least squared reconstruction error (weighted per input column by
    `importance` (in,) when given): `coarse` factors for every row, then `fine` more around each row's
    best. f = 1 (round-to-nearest's scale) is a candidate and wins ties, so no row's error is above
    round-to-nearest's."""
    if coarse < 1 or fine < 0:
        raise ValueError(f"coarse, fine: need coarse >= 1 and fine >= 0, got {coarse}, {fine}")
    _, base = quantize_rows(w, name)  # RTN's scales; also checks the shape and finiteness
    w32 = w.detach().float()
    imp = None if importance is None else importance.detach().float().reshape(1, -1)
    if imp is not None and imp.shape[1] != w32.shape[1]:
        raise ValueError(f"{name}: importance has {imp.shape[1]} entries for {w32.shape[1]} input features")
    step = 0.5 / coarse
    best_f = torch.ones_like(base)  # (out, 1)
    best_e = _row_errors(w32, 1.0 / base, imp)  # in units of base^2; a candidate's is scaled by (s / base)^2
    cands = [torch.full_like(base, 1.0 - k * step) for k in range(1, coarse)]
    centre = None
    for i in range(len(cands) + fine):
        if i == len(cands):  # the fine pass, around each row's best coarse factor
            centre = best_f.clone()
        f = cands[i] if centre is None else (centre + step * ((i - len(cands) + 1) / (fine + 1) - 0.5)).clamp_(0.5, 1.0)
        e = _row_errors(w32, f / base, imp) / f.square()
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_f = torch.where(better, f, best_f)
    scale = base / best_f
    q = (w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def search_quantize(model: torch.nn.Module, keep: frozenset[str] = frozenset(),
                    on_layer: Callable[[str], None] | None = None, coarse: int = COARSE_STEPS) -> int:
    """Replace the block Linears of `model` (float) by engines.transforms.fp8.Fp8Linear holding
    search_rows' codes and scales (layers named in `keep` stay float); save_checkpoint then writes a
    standard FP8 file. `on_layer(name)` is called as each layer is done; coarse=1 is round-to-nearest's absmax
    scales. Returns the layers quantized."""
    from engines.transforms.fp8 import BLOCK_LINEARS, Fp8Linear

    names = sorted(n for n, m in model.named_modules() if n.endswith(BLOCK_LINEARS) and n not in keep
                   and isinstance(m, torch.nn.Linear))
    for name in names:
        lin = model.get_submodule(name)
        fp8 = Fp8Linear.quantize(lin, getattr(lin, "comm", None))
        fp8.weight.data, fp8.weight_scale.data = search_rows(lin.weight, name, coarse=coarse, fine=0 if coarse == 1 else FINE_STEPS)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, fp8)
        if on_layer is not None:
            on_layer(name)
    return len(names)
