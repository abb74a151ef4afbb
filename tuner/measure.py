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
- a real `shardserve serve` of the shallow probe as one in-replica shard and as TP2 over Ray
  shard actors, requests sent by the load tester: TTFT of requests one at a time beyond the
  engine's prefill step -> request_overhead_ms; a burst of requests all in flight at once, where
  streaming every token through Ray and the gateway competes with the engine for the cores,
  calibrates that streaming cost per token (the simulator, on the burst's own schedule, matches
  its TPOT p50), added to every layout's seq_overhead_us; TPOT of the TP2 copy (one request at a
  time) beyond its layout's decode step and that streaming cost is what the Ray executor's calls
  add per step over the multiprocess executor the fit ran on, added to the step_overhead_ms of
  every layout of several shards.
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
SERVE_PROMPT, SERVE_OUTPUT = 16, 17  # tokens of the gateway probe's requests (as the load tester counts them)
BUSY_RATE, BUSY_PROMPTS = 200.0, 24  # the busy probe run: a burst, ~all 24 in flight at once
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


def measure_serving(model_dir: Path, work_dir: Path, layouts: dict[str, tuple[int, int, int]],
                    dtype: str = "float32") -> dict[str, dict[str, object]]:
    """Serve the probe once per layout {name: (tp, pp, threads per shard)} in one `shardserve serve`
    (fractional CPU reservations so that every copy fits; threads set as the tuner's deployments
    give them) and time requests through the gateway with the load tester, one layout at a time:
    {name: {"quiet": report, "busy": report}}: requests one at a time, and a burst that keeps
    BUSY_BATCH or so in flight (the gateway's streaming work then competes with the engine)."""
    import yaml

    from loadtest.config import LoadTestConfig
    from loadtest.runner import run
    from tuner.server import Server

    models = []
    for name, (tp, pp, threads) in layouts.items():
        share = 0.9 / len(layouts) / (tp * pp + 1)  # the probe copies share the host; Ray needs only to place them
        models.append({"name": name, "path": str(model_dir), "num_cpus": round(share, 3),
                       **({"shard_num_cpus": round(share, 3)} if tp * pp > 1 else {}),
                       "engine": {"dtype": dtype, "worker_threads": threads, "tensor_parallel_size": tp,
                                  "pipeline_parallel_size": pp, **({"pipeline_microbatches": 1} if pp > 1 else {})}})
    conf = work_dir / "probe.yaml"
    conf.write_text(yaml.safe_dump({"models": models}))
    out: dict[str, dict[str, object]] = {}
    with Server(["--config", str(conf)], work_dir / "serve.log") as url:
        for name in layouts:
            base = {"url": url, "model": name, "backend": "openai-completions", "arrival": "constant",
                    "random_input_len": SERVE_PROMPT, "tokenizer": model_dir / "tokenizer.json",
                    "ignore_eos": True, "progress": False, "seed": 1, "random_output_len": SERVE_OUTPUT}
            run(LoadTestConfig(**{**base, "random_output_len": 8}, request_rate=4.0, num_prompts=4))  # warm-up
            out[name] = {"quiet": run(LoadTestConfig(**base, request_rate=4.0, num_prompts=12))}
            if name == "one":
                out[name]["busy"] = run(LoadTestConfig(**base, request_rate=BUSY_RATE, num_prompts=BUSY_PROMPTS))
    return out


def calibrate_token_overhead(cost, report, extra_tokens: int, request_overhead_s: float) -> float:
    """Seconds per streamed token that, added to every sequence's share of a step, make the
    simulator's TPOT p50 on the busy probe run's own schedule equal the measured one (bisection)."""
    import numpy as np

    from engines.config import EngineConfig
    from engines.scheduler import SchedulerConfig
    from tuner.simulate import simulate

    recs = [r for r in report.records if not r.warmup and r.ok]
    arrivals = np.array([r.sent_s for r in recs])
    ins = np.array([r.input_tokens + extra_tokens for r in recs])
    outs = np.array([r.requested_output_tokens for r in recs])
    target = float(np.percentile([r.tpot_s for r in recs], 50))
    defaults = EngineConfig()  # the probe is served with the engine's default limits
    sched = SchedulerConfig(max_num_seqs=defaults.max_num_seqs, max_num_batched_tokens=defaults.max_num_batched_tokens,
                            block_size=defaults.block_size, num_blocks=4096, max_model_len=int(ins.max() + outs.max() + 1))

    def tpot(extra_s: float) -> float:
        traces = simulate(lambda w: cost.step_time(w) + extra_s * w.sampled, sched, arrivals, ins, outs,
                          request_overhead=request_overhead_s)
        return float(np.percentile([t.tpot for t in traces if len(t.token_times) > 1], 50))

    lo, hi = 0.0, 0.01
    if tpot(lo) >= target:
        return 0.0
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot(mid) < target else (lo, mid)
    return (lo + hi) / 2


def measure(name: str = "this-machine", serve: bool = True, progress: Callable[[str], None] = print,
            dtype: str = "auto") -> HardwareProfile:
    """Measure this machine; `serve=False` skips the gateway probe (request_overhead_ms stays 0).
    The engine constants are fitted on steps in `dtype` ("auto": what the engine picks here, bf16
    on CPUs with AMX or AVX512-BF16, else float32), the dtype the profile's configs should serve in."""
    import torch

    from engines.config import EngineConfig, resolved_dtype
    from tuner.cost import CostModel, StepWork
    from tuner.measure_comm import measure_gloo
    from tuner.measure_engine import PROBE_POSITIONS, PROBES, measure_layouts
    from tuner.probe_model import gpt2_shape, prompt_extra_tokens

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
        request_ms, tok_us, remote_ms = 0.0, 0.0, 0.0
        if serve:
            # one copy per kind of executor: in the replica (one shard) and Ray shard actors (TP2)
            served_layouts = {"one": (1, 1, cores), **({"sharded": (2, 1, prof.threads(2))} if cores >= 2 else {})}
            progress(f"gateway + Ray overhead: `shardserve serve` of the shallow probe as "
                     f"{', '.join(f'TP{t} PP{p}' for t, p, _ in served_layouts.values())}, load tester requests")
            n_layer, n_head, n_embd, vocab = PROBES[0]
            cfg = gpt2_shape(n_layer, n_head, n_embd, vocab, PROBE_POSITIONS)
            probe_dir = Path(tmp) / f"probe-{n_layer}x{n_embd}"
            served = measure_serving(probe_dir, Path(tmp), served_layouts, dtype)
            extra = prompt_extra_tokens(probe_dir / "tokenizer.json")
            plen = SERVE_PROMPT + extra  # what the engine prefills

            def engine(tp: int, pp: int) -> tuple[float, float]:
                """The layout's own prefill step and mean decode step for the probe requests (s)."""
                cost = CostModel(cfg, prof, tp=tp, pp=pp, weight_dtype=dtype)
                pre = cost.step_time(StepWork(tokens=plen, sampled=1, prefill_attn_pairs=plen * (plen + 1) // 2))
                dec = cost.step_time(StepWork(tokens=1, sampled=1, decode_context=plen + SERVE_OUTPUT // 2))
                return pre, dec

            pre, _ = engine(1, 1)
            quiet = served["one"]["quiet"].summary
            request_ms = max(quiet.ttft_ms.p50 * 1e-3 - pre, 0.0) * 1e3
            # streaming each token through Ray and the gateway: calibrated where it competes with the
            # engine for the cores (a busy run), on that run's own schedule
            tok_us = calibrate_token_overhead(CostModel(cfg, prof, weight_dtype=dtype), served["one"]["busy"], extra,
                                              request_ms * 1e-3) * 1e6
            if "sharded" in served:
                # per step, what Ray actor calls add over the multiprocess executor's pipes (the layouts'
                # fits measured the latter), beyond the streaming cost every layout pays
                _, dec2 = engine(2, 1)
                remote_ms = max(served["sharded"]["quiet"].summary.tpot_ms.p50 * 1e-3 - dec2 - tok_us * 1e-6, 0.0) * 1e3
    # streaming a token through Ray and the gateway costs every layout alike (per sampled sequence);
    # a layout of several shards also pays the Ray executor's calls once per step
    layouts = {k: {**v, "seq_overhead_us": round(v["seq_overhead_us"] + tok_us, 3),
                   "step_overhead_ms": round(v["step_overhead_ms"] + (remote_ms if k != "1x1" else 0.0), 4)}
               for k, v in prof.layouts.items()}
    errs = ", ".join(f"{k} {v['probe_median_error_pct']:.0f}% (max {v['probe_max_error_pct']:.0f}%"
                     + (f"; measured twice, the other pass {v['retried_from_median_error_pct']:.0f}%"
                        if "retried_from_median_error_pct" in v else "") + ")"
                     for k, v in layouts.items())
    prof = prof.replace(layouts=layouts, request_overhead_ms=round(float(request_ms), 3),
                        seq_overhead_us=round(float(prof.seq_overhead_us + tok_us), 3),
                        fit_notes=(f"measured by `shardserve tune profile` in {time.perf_counter() - t_start:.0f} s "
                                   f"on {cores} CPUs (torch {torch.__version__}); per-layout engine constants "
                                   f"fitted on {dtype} probe steps through each layout's real executor (median / "
                                   f"max error of the fit on its own steps: {errs}); seq_overhead_us includes "
                                   f"{tok_us:.0f} us of streaming per token through the gateway, and the "
                                   f"step_overhead_ms of layouts of several shards {remote_ms:.2f} ms of Ray "
                                   f"executor calls per step"
                                   f"{'' if serve else ' (not measured: --no-serve)'}"))
    return prof
