"""The Linears of one GPT-2-124M decode step (12 layers' QKV, out-proj, MLP up and down, and the
50,257-entry head) at 1-32 rows: the panel kernel (engines/cpu/panel_kernel.py) against oneDNN's
prepacked kernel and plain F.linear (and, where the panel kernel's auto runs other code than its avx2 variant, an
AVX-512 or AMX host, that variant: fast_linear's "panel_avx2"), on 1 and 2 threads, fp32 and bf16, each weight read
cold (a ring of copies larger than the last-level cache, as in a model).

    python benchmarks/bench_panel_kernel.py
    python benchmarks/bench_panel_kernel.py --fp8
    python benchmarks/bench_panel_kernel.py --rows 48,64,512,2048 --dtypes bfloat16 --threads 2

--rows / --dtypes / --threads: other row counts (decode batches of 48-64 rows, prefill chunks), dtypes and thread
counts than the default 1-32 rows, fp32 and bf16, 2 and 1 threads.

--fp8: SmolLM2-135M's decode Linears (30 layers and the 49,152-entry head) through the FP8 weight-only
kernel (one byte a weight, each variant this CPU runs) against the bf16 panel kernel, at 1 and 4 rows.

Prints the CPU model, the fp32 matmul and streaming-read ceilings measured in the same run, and per
case the step's Linear time, its GFLOP/s and its weight-read rate."""
import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import matmul_peak, read_bandwidth
from engines.core.hardware import cpu_name
from engines.cpu.fast_linear import PANEL_KINDS, pack_weight, packing_available, panel_avx2_offered
from engines.cpu.panel_kernel import fp8_linear, fp8_pack_panels, fp8_variant, load, pack_panels, panel_linear

SHAPES = ((2304, 768, 12), (768, 768, 12), (3072, 768, 12), (768, 3072, 12), (50257, 768, 1))
"""(out, in, count per step): GPT-2-124M's block Linears and its head."""


def call(kind: str, x: torch.Tensor, w: torch.Tensor, out_f: int) -> torch.Tensor:
    if kind == "packed":
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if kind in PANEL_KINDS:
        return panel_linear(x, w, out_f, None, PANEL_KINDS[kind])
    return F.linear(x, w)


def step_seconds(kind: str, rows: int, dtype: torch.dtype, reps: int = 15) -> float:
    total = 0.0
    for out_f, in_f, count in SHAPES:
        copies = 1 if out_f > 10000 else 8  # 8 x 7-9 MB fp32 > a 32 MB L3
        ws = [(torch.randn(out_f, in_f) * 0.02).to(dtype) for _ in range(copies)]
        prepared = [pack_weight(w) if kind == "packed" else pack_panels(w) if kind in PANEL_KINDS else w for w in ws]
        x = torch.randn(rows, in_f).to(dtype)
        for i in range(3):
            call(kind, x, prepared[i % copies], out_f)
        t = time.perf_counter()
        for i in range(reps):
            call(kind, x, prepared[i % copies], out_f)
        total += (time.perf_counter() - t) / reps * count
    return total


SMOLLM2 = ((960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1))
"""(out, in, count per step): SmolLM2-135M's block Linears (qkv with 9 q / 3 kv heads of 64, the fused
gate/up) and its head."""


def fp8_step_seconds(kind: str, rows: int, reps: int = 10) -> float:
    """One decode step's Linears through `kind` ("bf16" panel, or an FP8 variant), weights read cold."""
    total = 0.0
    for out_f, in_f, count in SMOLLM2:
        copies = 1 if out_f > 10000 else 16
        ws = [torch.randn(out_f, in_f) * 0.02 for _ in range(copies)]
        if kind == "bf16":
            prep = [pack_panels(w.to(torch.bfloat16)) for w in ws]
            def fn(x, i, prep=prep, copies=copies, out_f=out_f):
                return panel_linear(x, prep[i % copies], out_f, None)
        else:
            prep = [fp8_pack_panels((w / 0.001).to(torch.float8_e4m3fn)) for w in ws]
            scales = torch.full((out_f,), 0.001)
            def fn(x, i, prep=prep, copies=copies, out_f=out_f, scales=scales):
                return fp8_linear(x, prep[i % copies], scales, out_f, None, variant=kind)
        x = torch.randn(rows, in_f).to(torch.bfloat16)
        for i in range(3):
            fn(x, i)
        t = time.perf_counter()
        for i in range(reps):
            fn(x, i)
        total += (time.perf_counter() - t) / reps * count
    return total


def fp8_main() -> None:
    print(f"CPU: {cpu_name()}, torch {torch.__version__}; FP8 auto variant: {fp8_variant('auto')}")
    variants = [v for v in ("portable", "avx2", "avx512") if _runs(v)]
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for rows in (1, 4):
            bf = fp8_step_seconds("bf16", rows)
            cells = "  ".join(f"fp8 {v} {fp8_step_seconds(v, rows) * 1e3:6.2f} ms" for v in variants if v != "portable")
            print(f"threads={threads} rows={rows}: bf16 panel {bf * 1e3:6.2f} ms  {cells}  "
                  f"bf16 / fp8 auto {bf / fp8_step_seconds('auto', rows):.2f}x", flush=True)


def _runs(variant: str) -> bool:
    try:
        return fp8_variant(variant) == variant
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp8", action="store_true", help="SmolLM2's decode Linears through the FP8 kernel")
    ap.add_argument("--rows", default="1,4,8,16,32", help="row counts, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and / or bfloat16")
    ap.add_argument("--threads", default="2,1", help="thread counts, comma-separated")
    args = ap.parse_args()
    if args.fp8:
        return fp8_main()
    print(f"CPU: {cpu_name()}, torch {torch.__version__}")
    mod, why = load()
    print(why)
    if mod is None:
        raise SystemExit(1)
    print(f"ceilings: fp32 matmul {matmul_peak(torch.float32) / 1e9:.1f} GFLOP/s, "
          f"streaming read {read_bandwidth() / 1e9:.1f} GB/s")
    macs = sum(o * i * c for o, i, c in SHAPES)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        kinds = ["linear", *(["packed"] * packing_available(dtype)), "panel", *(["panel_avx2"] * panel_avx2_offered(dtype))]
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                res = {k: step_seconds(k, rows, dtype) for k in kinds}
                gb = macs * torch.empty((), dtype=dtype).element_size() / 1e9
                cells = "  ".join(f"{k} {s * 1e3:6.1f} ms ({2 * macs * rows / s / 1e9:5.0f} GFLOP/s, {gb / s:4.1f} GB/s)"
                                  for k, s in res.items())
                best_other = min(v for k, v in res.items() if k != "panel")
                print(f"{dtype!s:15s} threads={threads} rows={rows:3d}  {cells}  "
                      f"best other / panel {best_other / res['panel']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
