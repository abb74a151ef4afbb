"""Which kernel each FP8 Linear runs on a GPU, measured at load.

The ways to run an e4m3 Linear of shape (N out, K in) with per-channel weight scales:

- "rowwise": ScaledMMLinear (engines/transforms/fp8.py), x quantized per token, `torch._scaled_mm` with
  row-wise scales (M, 1) x (1, N). Exact per-channel maths in the kernel, but on Hopper with torch
  2.11 this path read weights at 1.2-2.5 TB/s (BENCHMARKS.md, GPU section).
- "tensorwise": TensorwiseScaledMMLinear below: x quantized with one scale for the whole
  activation, `_scaled_mm` with scalar scales (the fast CUTLASS path, 2.3-3.7 TB/s measured), and
  the per-channel weight scale applied to the (M, N) output afterwards (the epilogue: one
  multiply, fused with the bias by inductor when the decode step is compiled).
- "bf16": the weight dequantized once at load into a plain Linear (2 bytes a weight).
- "wo-*" (where triton runs, bf16 / fp16 models): engines/transforms/fp8_triton.py's weight-only kernel, x
  kept in bf16 and the e4m3 tiles widened in registers (no activation quantization, no epilogue launch), whole
  or split along K (its CONFIGS).

`choose_kernels` times every variant of each distinct layer shape at the decode batch sizes (1 / 8 / 64 rows),
in CUDA graphs of calls over several layers of that shape in turn (what the engine replays, with weights
that do not sit in L2), and keeps the fastest per row count: a shape can run the split weight-only kernel at
one row and `_scaled_mm` at 64 (`Fp8ByRows`). bf16 is all or nothing (it costs a second copy of the weight),
taken where its total time is no more than the FP8 plan's: FP8 is therefore never slower than bf16 on the
device it runs on, layer shape by layer shape. The plan is a pure function of the timings (`pick`), which is
what the CPU tests check.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, SCALE_EPS

log = logging.getLogger(__name__)

TIMING_ROWS = (1, 8, 64)
"""Decode batch sizes each variant is timed at; the sum of the times decides."""


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scalar scale): one dynamic scale for the whole activation."""
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32)  # ()
    scale = (amax / FP8_MAX).clamp_min(SCALE_EPS)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class TensorwiseScaledMMLinear(nn.Module):
    """W8A8 with scalar scales in the product and the per-channel weight scale after it:
    y = (x_q W_q^T) * s_x * s_w[None, :] (+ bias). `src` is an engines.transforms.fp8.Fp8Linear."""

    def __init__(self, src: nn.Module):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        self.weight = src.weight  # (N, K) e4m3; .t() is the column-major (K, N) _scaled_mm wants
        self.weight_scale_row = nn.Parameter(src.weight_scale.detach().float().reshape(1, -1),
                                             requires_grad=False)  # (1, N) fp32
        self.bias, self.comm = src.bias, src.comm
        self.register_buffer("one", torch.ones((), dtype=torch.float32, device=src.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        xq, xs = quantize_tensor(x2)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.one, out_dtype=torch.float32)  # (M, N)
        y = (y * self.weight_scale_row).to(x.dtype)  # the epilogue: per-channel weight scale
        if self.comm is not None:
            y = self.comm.all_reduce(y, "tp_layer")
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def pick(timings: dict[str, list[float | None]]) -> tuple[str, ...]:
    """The plan for one layer shape: a variant per timed row count (the fastest there). bf16 keeps a second,
    2-byte copy of the weight, so it is all or nothing: it runs every row count when its total time is no more
    than the FP8 plan's (ties keep bf16). A variant that failed to run at any row count (None) is out."""
    ok = {k: v for k, v in timings.items() if v and all(t is not None for t in v)}
    n = max((len(v) for v in timings.values()), default=1)
    fp8 = {k: v for k, v in ok.items() if k != "bf16"}
    if not fp8:
        return ("bf16",) * n
    plan = tuple(min(fp8, key=lambda k, i=i: fp8[k][i]) for i in range(n))
    if "bf16" in ok and sum(ok["bf16"]) <= sum(fp8[v][i] for i, v in enumerate(plan)):
        return ("bf16",) * n
    return plan


def row_slot(m: int, rows: tuple[int, ...]) -> int:
    """The index of the timed row count nearest to m on a log scale (1 / 8 / 64: m <= 2, <= 22, larger)."""
    best = 0
    for i in range(1, len(rows)):  # a plain loop: torch.compile traces it (min(key=) it cannot)
        if abs(math.log(max(m, 1) / rows[i])) < abs(math.log(max(m, 1) / rows[best])):
            best = i
    return best


class Fp8ByRows(nn.Module):
    """One FP8 Linear whose kernel depends on the call's row count: `variants` (name -> module, all sharing the
    e4m3 weight) and `plan` (a variant name per `rows` entry, from pick). A captured or compiled decode step
    has a fixed row count, so the choice is made once per graph."""

    def __init__(self, variants: dict[str, nn.Module], plan: tuple[str, ...],
                 rows: tuple[int, ...] | None = None):
        super().__init__()
        self.variants = nn.ModuleDict(variants)
        self.plan, self.rows = plan, rows or TIMING_ROWS
        first = next(iter(variants.values()))
        self.in_features, self.out_features = first.in_features, first.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.variants[self.plan[row_slot(x.numel() // self.in_features, self.rows)]](x)

    def extra_repr(self) -> str:
        return "rows " + ", ".join(f"~{r}: {v}" for r, v in zip(self.rows, self.plan))


def time_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds a call of fn, replayed `reps` times inside one CUDA graph (launch costs as in the
    engine's replayed decode step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best / reps


def timing_group(group: list[nn.Module], max_layers: int = 8) -> list[nn.Module]:
    """Layers of one shape to time together, in turn (as the model runs them): enough that their e4m3 weights
    are twice the device's L2 cache, so that no variant is timed on weights the cache holds between calls (the
    Llama-8B qkv's 25 MB fit the H200's L2 alone)."""
    dev = group[0].weight.device
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    out, nbytes = [], 0
    for layer in group[:max_layers]:
        out.append(layer)
        nbytes += layer.weight.numel() * layer.weight.element_size()
        if nbytes >= 2 * l2:
            break
    return out


TIMINGS: dict[tuple[int, int, bool], dict[str, list[float | None]]] = {}
"""The last choose_kernels' timings (seconds a call) per shape, for benchmarks to print."""


def choose_kernels(layers: list[nn.Module], dtype: torch.dtype, make: dict[str, Callable[[nn.Module], nn.Module]],
                   rows: tuple[int, ...] = TIMING_ROWS) -> dict[tuple[int, int, bool], tuple[str, ...]]:
    """Time each variant (`make[variant](fp8_layer) -> module`) once per distinct (K, N, row-parallel) shape on
    the layers' CUDA device, over timing_group's layers of that shape in turn; returns shape -> plan (pick's
    variant per row count of `rows`), logged with the timings."""
    groups: dict[tuple[int, int, bool], list[nn.Module]] = {}
    for layer in layers:
        groups.setdefault((layer.in_features, layer.out_features, layer.comm is not None), []).append(layer)
    choice: dict[tuple[int, int, bool], tuple[str, ...]] = {}
    for key, group in groups.items():
        if key[2]:  # a row-parallel shard all-reduces inside: not timed alone
            choice[key] = ("rowwise",) * len(rows)
            continue
        subset = timing_group(group)
        timings: dict[str, list[float | None]] = {}
        for variant, build in make.items():
            mods = [build(layer) for layer in subset]
            ts: list[float | None] = []
            for m in rows:
                x = torch.randn(m, key[0], device=subset[0].weight.device, dtype=dtype)
                try:
                    with torch.inference_mode():
                        t = time_graph(lambda mods=mods, x=x: [mod(x) for mod in mods], max(2, 24 // len(mods)))
                    ts.append(t / len(mods))
                except Exception as exc:  # noqa: BLE001 (a variant this build cannot run or compile for this shape)
                    log.info("fp8 kernel %s unavailable for %s: %s", variant, key, exc)
                    ts.append(None)
            timings[variant] = ts
            del mods
        choice[key] = pick(timings)
        TIMINGS[key] = timings
        log.info("fp8 kernels for Linear %dx%d (%d layers timed in turn): %s at rows %s (us a call: %s)", key[1],
                 key[0], len(subset), choice[key], rows,
                 {k: [round(t * 1e6, 1) if t is not None else None for t in v] for k, v in timings.items()})
    return choice
