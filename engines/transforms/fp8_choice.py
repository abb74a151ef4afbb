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
- "wo-n32" (where triton runs, bf16 / fp16 models): engines/transforms/fp8_triton.py's weight-only kernel, x
  kept in bf16 and the e4m3 tiles widened in registers (no activation quantization, no epilogue launch).

`choose_kernels` times every variant of each distinct layer shape at the decode batch sizes, in
CUDA graphs of repeated calls (what the engine replays), and keeps the fastest: FP8 is therefore
never slower than bf16 on the device it runs on, layer shape by layer shape. The choice is a pure
function of the timings (`pick`), which is what the CPU tests check.
"""

from __future__ import annotations

import logging
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


def pick(timings: dict[str, list[float]]) -> str:
    """The variant with the least total time over the timed row counts; bf16 wins ties and any
    variant that failed to run (None in its list) is out."""
    ok = {k: sum(v) for k, v in timings.items() if v and all(t is not None for t in v)}
    if not ok:
        return "bf16"
    best = min(ok.values())
    return "bf16" if ok.get("bf16") == best else min(ok, key=ok.get)


def time_graph(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
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


def choose_kernels(layers: list[nn.Module], dtype: torch.dtype, make: dict[str, Callable[[nn.Module], nn.Module]],
                   rows: tuple[int, ...] = TIMING_ROWS) -> dict[tuple[int, int, bool], str]:
    """Time each variant (`make[variant](fp8_layer) -> module`) once per distinct (K, N, row-parallel)
    shape on the layers' CUDA device; returns shape -> chosen variant (logged with the timings)."""
    choice: dict[tuple[int, int, bool], str] = {}
    for layer in layers:
        key = (layer.in_features, layer.out_features, layer.comm is not None)
        if key in choice:
            continue
        if layer.comm is not None:  # a row-parallel shard all-reduces inside: not timed alone
            choice[key] = "rowwise"
            continue
        timings: dict[str, list[float]] = {}
        for variant, build in make.items():
            mod = build(layer)
            ts: list[float] = []
            for m in rows:
                x = torch.randn(m, layer.in_features, device=layer.weight.device, dtype=dtype)
                try:
                    with torch.inference_mode():
                        ts.append(time_graph(lambda mod=mod, x=x: mod(x)))
                except Exception as exc:  # noqa: BLE001 (a variant this build cannot run or compile for this shape)
                    log.info("fp8 kernel %s unavailable for %s: %s", variant, key, exc)
                    ts.append(None)
            timings[variant] = ts
            del mod
        choice[key] = pick(timings)
        log.info("fp8 kernel for Linear %dx%d: %s (us at rows %s: %s)", key[1], key[0], choice[key], rows,
                 {k: [round(t * 1e6, 1) if t is not None else None for t in v] for k, v in timings.items()})
    return choice
