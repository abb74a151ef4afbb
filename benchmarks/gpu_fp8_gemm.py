"""Where W8A8 decode loses to bf16 on a Hopper GPU: one Linear of a Llama-8B shape, per kernel variant.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_fp8_gemm.py [--out $OUT/fp8_gemm.json]     # CUDA only

For each weight shape (N, K) and row count M: microseconds a call (CUDA graph of 50 calls,
replayed 20 times, events; weights rotate over 4 copies so L2 never holds them) and the weight
read rate that implies, for bf16 F.linear, torch._scaled_mm with row-wise scales (what
engines.transforms.fp8.ScaledMMLinear runs), the same with use_fast_accum, tensor-wise scales (+ fast accum),
and engines.transforms.fp8.quantize_tokens alone. Also the relative error of each fp8 product against the
bf16 one on the same random data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.transforms.fp8 import quantize_tokens
from engines.transforms.fp8_format import quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "up (gate+up)": (28672, 4096), "down": (4096, 14336)}


def time_us(fn, copies: int) -> float:
    """Per call, from a graph of 50 calls cycling over `copies` inputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(50):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (20 * 50)


def make_variants(x, xq, xs, xq_t, xs_t, w, wq, ws_row, wq_t, ws_t) -> dict:
    """The kernels timed, each a function of the weight copy it reads."""
    return {
        "bf16": lambda i: F.linear(x, w[i]),
        "rowwise": lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=xs, scale_b=ws_row[i], out_dtype=torch.bfloat16),
        "row+fast": lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=xs, scale_b=ws_row[i], out_dtype=torch.bfloat16,
                                               use_fast_accum=True),
        "tensor": lambda i: torch._scaled_mm(xq_t, wq_t[i].t(), scale_a=xs_t, scale_b=ws_t[i], out_dtype=torch.bfloat16),
        "tensor+fast": lambda i: torch._scaled_mm(xq_t, wq_t[i].t(), scale_a=xs_t, scale_b=ws_t[i],
                                                  out_dtype=torch.bfloat16, use_fast_accum=True),
        "quant": lambda i: quantize_tokens(x),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "CUDA only"
    torch.manual_seed(0)
    dev, C = "cuda", 4
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':14s} {'M':>4s} | {'bf16':>14s} | {'rowwise':>14s} | {'row+fast':>14s} | {'tensor':>14s} | "
          f"{'tensor+fast':>14s} | {'quant x':>8s} | err row / tensor")
    for name, (N, K) in SHAPES.items():
        w = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(C)]
        wq, ws = zip(*(quantize_rows(x) for x in w))  # (N, K) e4m3, (N, 1) fp32
        ws_row = [s.float().reshape(1, -1) for s in ws]
        ws_t = [s.float().max().reshape(()) for s in ws]  # a tensor-wise scale (coarser, for timing)
        wq_t = [(x.float() / st).clamp(-448, 448).to(torch.float8_e4m3fn) for x, st in zip(w, ws_t)]
        for M in (1, 8, 64, 512):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_tokens(x)
            xs_t = xs.max().reshape(())
            xq_t = (x.float() / xs_t).clamp(-448, 448).to(torch.float8_e4m3fn)
            variants = make_variants(x, xq, xs, xq_t, xs_t, w, wq, ws_row, wq_t, ws_t)
            t = {}
            for k, fn in variants.items():
                try:
                    t[k] = time_us(fn, C)
                except RuntimeError as exc:
                    t[k] = float("nan")
                    print(f"  {k} M={M}: {str(exc)[:120]}")
            ref = F.linear(x, w[0]).float()
            err = {k: float((v(0).float() - ref).norm() / ref.norm()) for k, v in
                   (("rowwise", variants["rowwise"]), ("tensor", variants["tensor"]))}
            wbytes = {"bf16": N * K * 2}
            gbs = {k: (N * K * (2 if k == "bf16" else 1)) / (t[k] * 1e-6) / 1e9 for k in t if k != "quant"}
            rows.append({"shape": name, "N": N, "K": K, "M": M, "us": t, "weight_gb_s": gbs, "rel_err": err,
                         "bytes": wbytes})
            cells = " | ".join(f"{t[k]:6.1f} {gbs[k]:5.0f}GB/s" for k in ("bf16", "rowwise", "row+fast", "tensor",
                                                                          "tensor+fast"))
            print(f"{name:14s} {M:4d} | {cells} | {t['quant']:6.1f}us | {err['rowwise']:.4f} / {err['tensor']:.4f}",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
