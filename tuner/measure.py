"""`shardserve tune profile`: measure this machine into a HardwareProfile YAML (in < 2 minutes).

What is measured, and which profile field it becomes:
- dense matmul rate per dtype, per activation row count and per thread count -> matmul_tflops
  (the cost model interpolates in log(rows) and picks the threads a shard of a layout gets), and
  how a Linear's rate moves with the model's width -> matmul_width_factor;
- read bandwidth of a buffer far past the last-level cache -> hbm_bandwidth_gb_s;
- the engine's own steps, per TP x PP layout of this host, through the executor that layout
  serves with (one in-process shard on every core; or one process per shard over gloo, the
  worker loop the Ray actors run), on two random probe checkpoints over decode and prefill
  batches of several sizes and contexts, fitted per layout (tuner.measure_engine) -> layouts
  (step, layer, sequence and attention costs and the engine's matmul time against the rate
  table); the one-shard layout's constants are also the global ones;
- gloo all-reduce and send/recv between two local processes -> collective_latency_us,
  send_latency_us, intra_node_bandwidth_gb_s (tuner.measure_comm);
- one real `shardserve serve` of two probes of different size in every layout (the layouts of
  several shards as Ray shard actors, as deployments run them), load-tested closed loop at 1, 4
  and 8 requests in flight (tuner.measure_served): per layout a factor from the engine in isolation
  to the served engine (the cores shared with Ray, the gateway and the client), a cost per step
  (the serving loop; the Ray executor's actor calls) and a cost per streamed token, fitted on
  every request's TPOT on its run's own simulated schedule -> the layout's constants; the
  one-shard copies' TTFT one at a time beyond their served prefill step -> request_overhead_ms.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import engines  # noqa: F401 - before torch: libgomp's wait policy (engines.cpu_threads) as the served engine has it
from tuner.profiles import HardwareProfile

ROWS = (1, 4, 16, 64, 256, 1024)
MATMUL_SHAPE = (768, 3072)  # (in, out) of a GPT-2-124M MLP projection: a representative Linear


def _best(fn: Callable[[], object], reps: int = 5, budget_s: float = 1.0) -> float:
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best


def measure_matmul(threads: tuple[int, ...], dtypes=("float32", "bfloat16"), rows=ROWS
                   ) -> dict[int, dict[str, dict[int, float]]]:
    """TFLOP/s of x (rows, in) @ W (in, out) by threads -> dtype -> rows. A dtype whose call
    takes over 0.3 s stops growing rows (bf16 without bf16 units is ~100x slower; the largest
    measured row count then stands for every larger one)."""
    import torch

    k, n = MATMUL_SHAPE
    out: dict[int, dict[str, dict[int, float]]] = {}
    before = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            out[th] = {}
            for dtype in dtypes:
                w = torch.randn(n, k, dtype=getattr(torch, dtype))
                table: dict[int, float] = {}
                for r in rows:
                    x = torch.randn(r, k, dtype=w.dtype)
                    dt = _best(lambda x=x, w=w: torch.nn.functional.linear(x, w), budget_s=0.5)
                    table[r] = round(2 * r * k * n / dt / 1e12, 6)
                    if dt > 0.3:
                        break
                out[th][dtype] = table
    finally:
        torch.set_num_threads(before)
    return out


WIDTHS = (256, 384, 768, 1024)  # model widths of the width factor (the rate table's shape is 768 -> 3072)


def measure_width_factor(dtype: str, widths=WIDTHS, rows=ROWS) -> dict[int, dict[int, float]]:
    """Rate of a (W -> 4W) Linear against the rate table's (768 -> 3072), one thread, by W -> rows."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates: dict[int, dict[int, float]] = {}
        for wd in sorted({*widths, MATMUL_SHAPE[0]}):
            wt = torch.randn(4 * wd, wd, dtype=getattr(torch, dtype))
            rates[wd] = {}
            for r in rows:
                x = torch.randn(r, wd, dtype=wt.dtype)
                dt = _best(lambda x=x, wt=wt: torch.nn.functional.linear(x, wt), budget_s=0.3)
                rates[wd][r] = 2 * r * wd * 4 * wd / dt
    finally:
        torch.set_num_threads(before)
    ref = rates[MATMUL_SHAPE[0]]
    return {wd: {r: round(v / ref[r], 4) for r, v in by_rows.items()} for wd, by_rows in rates.items()}


def measure_bandwidth(mib: int = 256) -> float:
    """GB/s of a float32 sum over `mib` MiB (far past a 32 MiB last-level cache)."""
    import torch

    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return buf.numel() * 4 / _best(lambda: buf.sum()) / 1e9


def measure(name: str = "this-machine", serve: bool = True, progress: Callable[[str], None] = print,
            dtype: str = "auto") -> HardwareProfile:
    """Measure this machine; `serve=False` skips the gateway probe (request_overhead_ms stays 0).
    The engine constants are fitted on steps in `dtype` ("auto": what the engine picks here, bf16
    on CPUs with AMX or AVX512-BF16, else float32), the dtype the profile's configs should serve in."""
    import torch

    from engines.config import EngineConfig, resolved_dtype
    from tuner.measure_comm import measure_gloo
    from tuner.measure_engine import measure_layouts

    dtype = resolved_dtype(EngineConfig(dtype=dtype))
    t_start = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = tuple(sorted({1, cores}))
    progress(f"matmul rates ({', '.join(map(str, threads))} threads; float32, bfloat16; rows {ROWS})")
    rates = measure_matmul(threads)
    progress(f"matmul rate by model width ({', '.join(map(str, WIDTHS))}; 1 thread, {dtype})")
    width_factor = measure_width_factor(dtype)
    progress("read bandwidth")
    bw = measure_bandwidth()
    progress("gloo all-reduce and send between 2 processes")
    comm = measure_gloo()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    base = HardwareProfile(
        name=name, kind="measured", memory_gib=round(mem_gib, 1), hbm_bandwidth_gb_s=round(bw, 2),
        flops_tflops={"float32": rates[cores]["float32"][max(rates[cores]["float32"])],
                      "bfloat16": rates[cores]["bfloat16"][max(rates[cores]["bfloat16"])]},
        matmul_tflops=rates, matmul_width_factor=width_factor, cores=cores, intra_node_bandwidth_gb_s=round(comm["allreduce_gb_s"], 3),
        inter_node_bandwidth_gb_s=round(comm["allreduce_gb_s"], 3), devices_per_node=cores,
        bw_efficiency=1.0, flops_efficiency=1.0, collective_latency_us=round(comm["allreduce_latency_us"], 1),
        send_latency_us=round(comm["send_latency_us"], 1), reserved_memory_gib=1.0)
    with tempfile.TemporaryDirectory(prefix="shardserve-profile-") as tmp:
        layouts = measure_layouts(base, Path(tmp), dtype, progress)
        # the global constants (used by layouts not measured here) are the one-shard layout's
        one = layouts["1x1"]
        prof = base.replace(layouts=layouts, step_overhead_ms=one["step_overhead_ms"],
                            layer_overhead_us=one["layer_overhead_us"], seq_overhead_us=one["seq_overhead_us"],
                            seq_layer_overhead_us=one["seq_layer_overhead_us"],
                            attention_prefill_tflops=one["attention_prefill_tflops"],
                            attention_kv_gb_s=one["attention_kv_gb_s"])
        request_ms, served_notes = 0.0, "not measured (--no-serve)"
        if serve:
            request_ms, layouts, served_notes = _served(prof, Path(tmp), dtype, progress)
            prof = prof.replace(layouts=layouts)
    one = prof.layouts["1x1"]
    errs = ", ".join(f"{k} {v['probe_median_error_pct']:.0f}% (max {v['probe_max_error_pct']:.0f}%"
                     + (f"; measured twice, the other pass {v['retried_from_median_error_pct']:.0f}%"
                        if "retried_from_median_error_pct" in v else "") + ")"
                     for k, v in prof.layouts.items())
    prof = prof.replace(request_overhead_ms=round(float(request_ms), 3),
                        **{k: one[k] for k in ("step_overhead_ms", "layer_overhead_us", "seq_overhead_us",
                                               "seq_layer_overhead_us", "attention_prefill_tflops",
                                               "attention_kv_gb_s")},
                        fit_notes=(f"measured by `shardserve tune profile` in {time.perf_counter() - t_start:.0f} s "
                                   f"on {cores} CPUs (torch {torch.__version__}); per-layout engine constants "
                                   f"fitted on {dtype} probe steps through each layout's real executor (median / "
                                   f"max error of the fit on its own steps: {errs}), then scaled to the served "
                                   f"engine (tuner.measure_served): {served_notes}"))
    return prof


def _served(prof: HardwareProfile, tmp: Path, dtype: str, progress: Callable[[str], None]
            ) -> tuple[float, dict[str, dict[str, float]], str]:
    """Serve the first two probes in every measured layout and fit each layout's served constants
    (tuner.measure_served); (request_overhead_ms, layouts, a note for fit_notes)."""
    import numpy as np

    from tuner.cost import CostModel
    from tuner.measure_engine import PROBE_POSITIONS, PROBES
    from tuner.measure_served import (
        SERVE_PROMPT,
        apply_served,
        fit_served,
        requests_of,
        serve_probes,
        served_prefill_s,
    )
    from tuner.probe_model import gpt2_shape, prompt_extra_tokens

    probes = []
    for n_layer, n_head, n_embd, vocab in PROBES[:2]:
        probes.append((gpt2_shape(n_layer, n_head, n_embd, vocab, PROBE_POSITIONS), tmp / f"probe-{n_layer}x{n_embd}"))
    copies, meta = {}, {}
    for key in prof.layouts:
        tp, pp = (int(v) for v in key.split("x"))
        for i, (cfg, path) in enumerate(probes):
            if cfg.n_head % tp or cfg.n_layer < pp:
                continue
            name = f"p{i}-{key}"
            copies[name] = (path, tp, pp, prof.threads(tp * pp))
            meta[name] = (key, CostModel(cfg, prof, tp=tp, pp=pp, weight_dtype=dtype), path)
    progress(f"served probes: `shardserve serve` of {len(copies)} copies ({', '.join(copies)}), load tester requests")
    served = serve_probes(copies, tmp, dtype, progress)
    extra = prompt_extra_tokens(probes[0][1] / "tokenizer.json")
    fits: dict[str, tuple[float, float, float, float, float]] = {}
    for key in prof.layouts:
        names = [(name, c) for name, (k, _, _) in meta.items() if k == key for c in served[name]]
        runs = [(meta[name][1], requests_of(served[name][c], extra)) for name, c in names]
        if runs:
            per_run: list[tuple[float, float]] = []
            fits[key] = fit_served(runs, per_run=per_run)
            progress(f"served {key}: TPOT p50 measured / fitted (ms): " + ", ".join(
                f"{name} at {c} in flight {m * 1e3:.1f} / {f * 1e3:.1f}" for (name, c), (m, f) in zip(names, per_run, strict=True)))
    # the gateway's cost per request: one-shard copies' TTFT one at a time beyond their served prefill
    over = []
    for name, (key, cost, _) in meta.items():
        if key == "1x1" and key in fits:
            ttft = float(np.median(requests_of(served[name][1], extra)["ttft"]))
            over.append(ttft - served_prefill_s(cost, *fits[key][:4], SERVE_PROMPT + extra))
    request_ms = max(float(np.mean(over)), 0.0) * 1e3 if over else 0.0
    layouts = {k: ({**apply_served(v, *fits[k][:4]), "served_scale": round(fits[k][0], 4),
                    "served_attention_scale": round(fits[k][1], 4), "served_fit_error_pct": round(fits[k][4], 2)}
                   if k in fits else v)
               for k, v in prof.layouts.items()}
    note = "; ".join(f"{k} x{f[0]:.2f} (attention x{f[1]:.2f}) + {f[2] * 1e3:.2f} ms per step + "
                     f"{f[3] * 1e6:.0f} us per token (median TPOT error {f[4]:.0f}%)" for k, f in fits.items())
    return request_ms, layouts, f"{note}; request overhead {request_ms:.1f} ms"
