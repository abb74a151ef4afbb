"""`shardserve tune profile`: measure this machine into a HardwareProfile YAML (in < 2 minutes).

What is measured, and which profile field it becomes:
- dense matmul rate per dtype, per activation row count and per thread count -> matmul_tflops
  (the cost model interpolates in log(rows) and picks the threads a shard of a layout gets);
- read bandwidth of a buffer far past the last-level cache -> hbm_bandwidth_gb_s;
- the engine's own steps on two random probe checkpoints (1 and 6 layers) over decode and
  prefill batches of several sizes and contexts, fitted by non-negative least squares after the
  matmul time is taken out -> step_overhead_ms, layer_overhead_us, seq_overhead_us,
  seq_layer_overhead_us, attention_kv_gb_s (decode, per context token), attention_prefill_tflops;
- gloo all-reduce and send/recv between two local processes -> collective_latency_us,
  send_latency_us, intra_node_bandwidth_gb_s (tuner.measure_comm);
- a real `shardserve serve` of the 1-layer probe, requests sent by the load tester: TTFT beyond
  the engine's prefill step -> request_overhead_ms; TPOT beyond the engine's decode step is the
  per-token cost of streaming through Ray and the gateway, added to seq_overhead_us.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tuner.profiles import HardwareProfile

ROWS = (1, 4, 16, 64, 256, 1024)
MATMUL_SHAPE = (768, 3072)  # (in, out) of a GPT-2-124M MLP projection: a representative Linear
PROBE = {"n_head": 4, "n_embd": 256, "vocab_size": 512, "positions": 1024}
PROBE_LAYERS = (1, 6)


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


def measure_bandwidth(mib: int = 256) -> float:
    """GB/s of a float32 sum over `mib` MiB (far past a 32 MiB last-level cache)."""
    import torch

    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return buf.numel() * 4 / _best(lambda: buf.sum()) / 1e9


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set: drop the most negative coefficient and re-solve."""
    keep = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            return x
        keep.pop(int(np.argmin(sol)))
    return x


def _engine_steps(model_dir: Path, scenarios: list[tuple[int, int, int]], dtype: str = "float32"
                  ) -> list[tuple[object, float]]:
    """Run the engine itself (weights and activations in `dtype`) on (batch, prompt_len, max_tokens)
    scenarios; (StepWork, seconds) per step."""
    from engines import EngineConfig, SamplingParams
    from engines.llm_engine import LLMEngine
    from tuner.simulate import work_of

    eng = LLMEngine(model_dir, EngineConfig(dtype=dtype, kv_cache_bytes=256 * 2**20, max_num_seqs=64,
                                            max_num_batched_tokens=4096))
    works: list = []
    orig = eng.scheduler.schedule

    def schedule():
        plan = orig()
        works.append(work_of(plan))
        return plan

    eng.scheduler.schedule = schedule  # observe the plans of this private probe engine
    rows: list[tuple[object, float]] = []
    rng = np.random.default_rng(0)
    try:
        # pass 0 (one small scenario) warms caches and the allocator and is not kept
        for rep, group in enumerate((scenarios[:1], scenarios)):
            for i, (batch, plen, out) in enumerate(group):
                for b in range(batch):
                    ids = rng.integers(1, PROBE["vocab_size"], plen).tolist()
                    eng.add_request(f"{rep}-{i}-{b}", ids, SamplingParams(max_tokens=out, ignore_eos=True))
                while eng.has_unfinished_requests():
                    works.clear()
                    t0 = time.perf_counter()
                    eng.step()
                    dt = time.perf_counter() - t0
                    if rep and works and works[-1].tokens:  # the first pass warms caches and the allocator
                        rows.append((works[-1], dt))
    finally:
        eng.shutdown()
    return rows


def fit_engine_constants(steps: list[tuple[object, float, object]]) -> dict[str, float]:
    """Fit the engine's fixed and attention costs from (StepWork, seconds, CostModel) rows: the
    step time less the cost model's matmul time, by non-negative least squares."""
    feats, ys = [], []
    for w, dt, cost in steps:
        m = cost.model
        layers = cost.pp * cost.layers_per_stage
        seqs = w.seqs or w.sampled
        pre_flops = 4 * m.n_head * m.hd * w.prefill_attn_pairs
        kv_bytes = 2 * m.kv_heads * m.hd * cost.kv_bytes * w.decode_context
        feats.append([1.0, layers, layers * seqs, w.sampled, layers * pre_flops, layers * kv_bytes])
        parts = cost.components(w)
        ys.append(dt - parts["matmul"] - parts["matmul_mt"])
    a, y = np.array(feats), np.array(ys)
    # relative errors: every step counts alike, long prefills do not drown the decode steps
    wgt = 1.0 / np.maximum(np.array([dt for _, dt, _ in steps]), 1e-6)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x = _nnls(a * wgt[:, None] / scale, y * wgt) / scale
    return {"step_overhead_ms": x[0] * 1e3, "layer_overhead_us": x[1] * 1e6, "seq_layer_overhead_us": x[2] * 1e6,
            "seq_overhead_us": x[3] * 1e6,
            "attention_prefill_tflops": 1 / x[4] / 1e12 if x[4] > 0 else 1e3,  # too cheap to see: effectively free
            "attention_kv_gb_s": 1 / x[5] / 1e9 if x[5] > 0 else 1e4}


def measure_serving(model_dir: Path, work_dir: Path, prefill_s: float, decode_s: float,
                    dtype: str = "float32") -> dict[str, float]:
    """Serve the probe with `shardserve serve` and time requests through the gateway with the load
    tester: what TTFT and TPOT add beyond the engine's own prefill and decode steps."""
    import yaml

    from loadtest.config import LoadTestConfig
    from loadtest.runner import run
    from tuner.server import Server

    conf = work_dir / "probe.yaml"
    conf.write_text(yaml.safe_dump({"models": [{"name": "probe", "path": str(model_dir), "engine": {"dtype": dtype}}]}))
    with Server(["--config", str(conf)], work_dir / "serve.log") as url:
        base = {"url": url, "model": "probe", "backend": "openai-completions", "arrival": "constant", "request_rate": 4.0,
                    "random_input_len": 16, "tokenizer": model_dir / "tokenizer.json", "ignore_eos": True, "progress": False,
                    "seed": 1}
        run(LoadTestConfig(**base, num_prompts=4, random_output_len=8))  # warm-up
        rep = run(LoadTestConfig(**base, num_prompts=16, random_output_len=17))
    s = rep.summary
    return {"request_overhead_ms": max(s.ttft_ms.p50 - prefill_s * 1e3, 0.0),
            "token_overhead_us": max(s.tpot_ms.p50 - decode_s * 1e3, 0.0) * 1e3}


def measure(name: str = "this-machine", serve: bool = True, progress: Callable[[str], None] = print,
            dtype: str = "auto") -> HardwareProfile:
    """Measure this machine; `serve=False` skips the gateway probe (request_overhead_ms stays 0).
    The engine constants are fitted on steps in `dtype` ("auto": what the engine picks here, bf16
    on CPUs with AMX or AVX512-BF16, else float32), the dtype the profile's configs should serve in."""
    import torch

    from engines.config import EngineConfig, resolved_dtype

    dtype = resolved_dtype(EngineConfig(dtype=dtype))

    from tuner.cost import CostModel
    from tuner.measure_comm import measure_gloo
    from tuner.probe_model import gpt2_shape, write_random_checkpoint

    t_start = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = tuple(sorted({1, cores}))
    progress(f"matmul rates ({', '.join(map(str, threads))} threads; float32, bfloat16; rows {ROWS})")
    rates = measure_matmul(threads)
    progress("read bandwidth")
    bw = measure_bandwidth()
    progress("gloo all-reduce and send between 2 processes")
    comm = measure_gloo()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    base = HardwareProfile(
        name=name, kind="measured", memory_gib=round(mem_gib, 1), hbm_bandwidth_gb_s=round(bw, 2),
        flops_tflops={"float32": rates[cores]["float32"][max(rates[cores]["float32"])],
                      "bfloat16": rates[cores]["bfloat16"][max(rates[cores]["bfloat16"])]},
        matmul_tflops=rates, cores=cores, intra_node_bandwidth_gb_s=round(comm["allreduce_gb_s"], 3),
        inter_node_bandwidth_gb_s=round(comm["allreduce_gb_s"], 3), devices_per_node=cores,
        bw_efficiency=1.0, flops_efficiency=1.0, collective_latency_us=round(comm["allreduce_latency_us"], 1),
        send_latency_us=round(comm["send_latency_us"], 1), reserved_memory_gib=1.0)
    progress("engine steps on random probe checkpoints")
    steps = []
    with tempfile.TemporaryDirectory(prefix="shardserve-profile-") as tmp:
        dirs = {}
        for layers in PROBE_LAYERS:
            cfg = gpt2_shape(layers, PROBE["n_head"], PROBE["n_embd"], PROBE["vocab_size"], PROBE["positions"])
            dirs[layers] = write_random_checkpoint(Path(tmp) / f"probe{layers}", cfg)
            cost = CostModel(cfg, base, weight_dtype=dtype)
            # (batch, prompt tokens, output tokens): decode at 3 batch sizes and 2 contexts, 2 prefills
            scenarios = [(1, 16, 12), (16, 16, 8), (48, 16, 4), (4, 400, 6), (1, 700, 2)]
            steps += [(w, dt, cost) for w, dt in _engine_steps(dirs[layers], scenarios, dtype)]
        fit = fit_engine_constants(steps)
        prof = base.replace(**{k: round(float(v), 4) for k, v in fit.items()})
        served = {"request_overhead_ms": 0.0, "token_overhead_us": 0.0}
        if serve:
            progress("gateway + Ray overhead: `shardserve serve` of the 1-layer probe, load tester requests")
            cost1 = CostModel(gpt2_shape(1, PROBE["n_head"], PROBE["n_embd"], PROBE["vocab_size"], PROBE["positions"]),
                              prof, weight_dtype=dtype)
            from tuner.cost import StepWork

            pre = cost1.step_time(StepWork(tokens=16, sampled=1, prefill_attn_pairs=16 * 17 // 2))
            dec = cost1.step_time(StepWork(tokens=1, sampled=1, decode_context=24))
            served = measure_serving(dirs[1], Path(tmp), pre, dec, dtype)
    prof = prof.replace(request_overhead_ms=round(float(served["request_overhead_ms"]), 3),
                        seq_overhead_us=round(float(prof.seq_overhead_us + served["token_overhead_us"]), 3),
                        fit_notes=(f"measured by `shardserve tune profile` in {time.perf_counter() - t_start:.0f} s "
                                   f"on {cores} CPUs (torch {torch.__version__}); engine constants fitted on "
                                   f"{len(steps)} {dtype} probe steps (serve in {dtype}); seq_overhead_us includes "
                                   f"{served['token_overhead_us']:.0f} us of streaming per token through the "
                                   f"gateway{'' if serve else ' (not measured: --no-serve)'}"))
    return prof
