"""The engine's own steps per TP x PP layout, through the executor that layout serves with.

A layout of one shard runs in-process on every core; a layout of several runs one process per
shard (engines.parallel's multiprocess executor: the same worker loop the Ray actors run, gloo
between local processes, cores // (tp * pp) threads each, one micro-batch per step as the
tuner's deployments ask). Each step's wall time is fitted, per layout, by non-negative least
squares on relative errors, as

    step = step_overhead + layers * layer_overhead + layers * seqs * seq_layer_overhead
           + sampled * seq_overhead + matmul_scale * matmul(one-thread rate table, model width)
           + layers * prefill_flops / attention_prefill_rate + layers * kv_bytes / attention_kv_rate
           + comm_scale * comm(gloo measurement) + sampled * vocab / tp * vocab_seq
           + streamed weight bytes / dram_weight_rate + [sampled > 0] * vocab * width / tp * head
           + [the step holds a prefill chunk] * prefill_step

matmul comes from the profile's one-thread bare-matmul table (its shape in rows and width; the
multi-thread table moves with whatever else runs on a shared host) and matmul_scale is where the
engine's Linear layers in that layout land against it (threads per shard, kernel choice, shards
sharing the cores); vocab_seq is the LM head's per-sequence work beyond its matmul; comm (TP all-reduces, PP sends) comes from tuner.measure_comm and comm_scale
is what the executor's real collectives and sends cost against it; streamed weight bytes are
those of a copy that outgrows the last-level cache (tuner.cost.CostModel.weight_stream_bytes: the
rate table is measured cache-resident); head is the LM head's per-step work by its size;
prefill_step is a prefill step's own fixed work (without it the probes' short prefills, 16 tokens
on a 2-layer probe costing 5x a decode step, were charged to per-token terms, which then
over-predicted GPT-2's 65-token prefills by 24-44%: BENCHMARKS.md, issue 15, w15-tuner6). Two probe checkpoints of different depth and width (and
vocabulary) let the fit tell the terms apart.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

# (n_layer, n_head, n_embd, vocab), head size 64: depths, widths and vocabularies apart, so that
# per-step, per-layer, per-FLOP, per-sequence-per-layer, per-sequence and per-sequence-per-
# vocabulary-entry costs can be told apart (three probes: the last three need three (layers, vocab))
PROBES = ((2, 6, 384, 8192), (6, 12, 768, 512), (4, 4, 256, 50257))
PROBE_POSITIONS = 1024
# (batch, prompt tokens, output tokens): decode at 3 batch sizes and 2 contexts, prefills of 3 sizes
SCENARIOS = ((1, 16, 10), (16, 16, 6), (48, 16, 4), (8, 300, 4), (4, 400, 2), (1, 700, 2))
ROBUST_ITERATIONS = 6
RETRY_ABOVE_PCT = 25.0
"""A layout whose fit is off its own steps by more than this (median %) is measured once more."""


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
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


def layouts_for(cores: int) -> list[tuple[int, int]]:
    """The (tp, pp) layouts of one model copy on a host of `cores` cores (tp * pp <= cores)."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if tp * pp <= max(cores, 1):
                out.append((tp, pp))
    return out


def engine_steps(model_dir: Path, scenarios, dtype: str, tp: int = 1, pp: int = 1, threads: int = 0,
                 vocab: int = 512) -> list[tuple[object, float]]:
    """Run the engine (its real executor for tp x pp) on (batch, prompt_len, max_tokens) scenarios;
    (StepWork, seconds) per step. Greedy sampling, as the load tester asks."""
    from engines import EngineConfig, SamplingParams
    from engines.core.llm_engine import LLMEngine
    from tuner.simulate import work_of

    cfg = EngineConfig(dtype=dtype, kv_cache_bytes=256 * 2**20, max_num_seqs=64, max_num_batched_tokens=4096,
                       tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_threads=threads,
                       pipeline_microbatches=1 if pp > 1 else 0)
    eng = LLMEngine(model_dir, cfg)
    works: list = []
    orig = eng.scheduler.schedule

    def schedule(max_steps: int = 1):
        plan = orig(max_steps)
        works.append(work_of(plan))
        return plan

    eng.scheduler.schedule = schedule  # observe the plans of this private probe engine
    rows: list[tuple[object, float]] = []
    rng = np.random.default_rng(0)
    try:
        # pass 0 (one small scenario) warms caches, the allocator and the shards' links; not kept
        for rep, group in enumerate((scenarios[:1], scenarios)):
            for i, (batch, plen, out) in enumerate(group):
                for b in range(batch):
                    ids = rng.integers(1, vocab, plen).tolist()
                    eng.add_request(f"{rep}-{i}-{b}", ids,
                                    SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0))
                while eng.has_unfinished_requests():
                    works.clear()
                    t0 = time.perf_counter()
                    eng.step()
                    dt = time.perf_counter() - t0
                    if rep and works and works[-1].tokens:
                        rows.append((works[-1], dt))
    finally:
        eng.shutdown()
    return rows


def _features(w, cost) -> list[float]:
    m = cost.model
    layers = cost.pp * cost.layers_per_stage
    pre_flops = 4 * (m.n_head // cost.tp) * m.hd * w.prefill_attn_pairs  # per shard
    kv_bytes = 2 * cost.kv_heads_per_device * m.hd * cost.kv_bytes * w.decode_context
    shard_threads = cost.profile.threads(cost.tp * cost.pp)
    return [1.0, layers, layers * (w.seqs or w.sampled), w.sampled, cost.matmul_time(w, threads=1),
            layers * pre_flops, layers * kv_bytes, cost.comm_time(w), w.sampled * m.vocab_size / cost.tp,
            cost.matmul_time(w, threads=shard_threads) if shard_threads > 1 else 0.0,
            layers * w.tokens * m.n_embd / cost.tp, cost.weight_stream_bytes(w),
            m.vocab_size * m.n_embd / cost.tp if w.sampled else 0.0,
            float(w.prefill_attn_pairs > 0),
            layers if multi_row_decode(w) else 0.0]


def multi_row_decode(w) -> bool:
    """A decode-only step of two sequences or more (tuner.cost: decode_batch_layer_us)."""
    return not w.prefill_attn_pairs and (w.seqs or w.sampled) >= 2


def fit_layout(steps: list[tuple[object, float, object]], threads: int = 1, vocab: bool | float = True,
               mean: bool = False, head: bool | float = True, dram: bool | float = True,
               prefill: bool | float = True, multi_row: bool | float = False) -> dict[str, float]:
    """A layout's constants (profiles.LAYOUT_KEYS) from (StepWork, seconds, CostModel) rows; the
    cost models carry the layout's tp and pp and a profile without layout constants. `threads`
    per shard bound matmul_scale from below: t threads at best divide the one-thread time by t.
    `vocab=False` leaves vocab_seq_ns at 0 (steps of two probes cannot tell it from the other
    per-sequence costs); a number fixes it at that many ns; `head` likewise for head_ns; `dram`
    likewise for the seconds per weight byte read past the cache (1 / dram_weight_gb_s / 1e9);
    `prefill` likewise for prefill_step_ms (ms); `multi_row` likewise for decode_batch_layer_us (us; off
    by default: only fit_on_engine's decode batches tell it).
    By default the fit follows the typical step (relative errors reweighted toward least absolute
    deviations); `mean=True` fits the mean step instead, relative to the geometric mean of the
    fitted and the measured time. The served fit (tuner.measure._served) used the mean from pass 9
    to pass 18, reasoning that steps other processes stretch are part of what a request waits for.
    But the probes' spread of slow steps is not a deployment's: a one-shard engine times each step
    class on 1 and 2 threads (engines.cpu.cpu_threads.AdaptiveThreads), every class starting on 2 for
    its first 8 steps, and the probes meet many classes young (pass 18: each prefill class 1-10
    steps in a copy's measured window, decode batches of 5-16 2-14, beside a few in the warm-up)
    and in bursts of arrivals; their step times are bimodal (the 6 x 384 probe at batch 6:
    6.3-8.7 ms, and 12.2-12.9 ms every second or third step). Against the accuracy runs' own served
    steps (each run's last ~250, passes 17 and 18) the mean fit predicted -7..+24% (+8% on average)
    of their mean, the typical fit -9..+10% (+1..+2%); and a per-sequence cost inflated by slow
    steps compounds under load (a bigger batch, a slower step, a longer queue: pass 18's default
    model TPOT at 0.8 x saturation +77% one-shard, +77% PP2)."""
    a = np.array([_features(w, cost) for w, _, cost in steps])
    dts = np.array([dt for _, dt, _ in steps])
    fixed = {j: 0.0 if v is False else float(v) * scale
             for j, v, scale in ((8, vocab, 1e-9), (12, head, 1e-9), (11, dram, 1.0), (13, prefill, 1e-3),
                                 (14, multi_row, 1e-6))
             if v is not True}
    full = a.copy()
    for j, v in fixed.items():
        dts = dts - v * a[:, j]  # the fixed part is not fitted
        a[:, j] = 0.0
    floor = 1.0 / max(threads, 1)  # the fit's matmul coefficient is matmul_scale - floor >= 0
    dts_fit = dts - floor * a[:, 4]
    if not a[:, 7].any():
        a[:, 7] = 0.0  # one shard: no communication to scale
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    # relative errors (long prefills do not drown the decode steps), iteratively reweighted toward
    # least absolute deviations: a step that another process on a shared host stretched several-fold
    # pulls the fit by its count, not by its square
    robust = np.ones(len(dts))
    denom = np.maximum(dts, 1e-6)
    for _ in range(ROBUST_ITERATIONS):
        wgt = robust / denom
        x = nnls(a * wgt[:, None] / scale, dts_fit * wgt) / scale
        if mean:
            # relative to the geometric mean of fitted and measured: relative to the fitted time
            # alone, an over-prediction costs at most 1 and the fit drifts slow (pass 9: its own
            # steps 1.20x); relative to the measured alone it drifts fast
            denom = np.sqrt(np.maximum(a @ x + floor * a[:, 4], 1e-6) * np.maximum(dts, 1e-6))
        else:
            robust = 1.0 / np.sqrt(np.maximum(np.abs((a @ x + floor * a[:, 4]) / dts - 1), 0.02))
    x[~a.any(axis=0)] = 0.0  # a column with no signal (fixed, or no step has it) gets nothing, not noise / 1e-30
    x[4] += floor
    for j, v in fixed.items():
        x[j] += v
        dts = dts + v * full[:, j]
        a[:, j] = full[:, j]
    rel = np.abs(a @ x / dts - 1) * 100
    return {"step_overhead_ms": x[0] * 1e3, "layer_overhead_us": x[1] * 1e6, "seq_layer_overhead_us": x[2] * 1e6,
            "seq_overhead_us": x[3] * 1e6,
            "matmul_scale": x[4],
            "comm_scale": x[7] if a[:, 7].any() else 1.0,
            "attention_prefill_tflops": 1 / x[5] / 1e12 if x[5] > 0 else 1e3,  # too cheap to see: effectively free
            "attention_kv_gb_s": 1 / x[6] / 1e9 if x[6] > 0 else 1e4,
            "vocab_seq_ns": x[8] * 1e9,
            "matmul_mt_scale": x[9],
            "token_layer_width_ns": x[10] * 1e9,
            "dram_weight_gb_s": 1 / x[11] / 1e9 if x[11] > 0 else 0.0,  # 0: no step read weights past the cache
            "head_ns": x[12] * 1e9,
            "prefill_step_ms": x[13] * 1e3,
            "decode_batch_layer_us": x[14] * 1e6,
            "probe_steps": len(steps), "probe_median_error_pct": float(np.median(rel)),
            "probe_mean_ratio": float(np.sum(a @ x) / np.sum(dts)),
            "probe_max_error_pct": float(rel.max())}


def measure_layouts(base, tmp: Path, dtype: str, progress=print) -> dict[str, dict[str, float]]:
    """Every layout of this host (layouts_for(base.cores)) measured on both probes and fitted."""
    from tuner.cost import CostModel
    from tuner.probe_model import gpt2_shape, write_random_checkpoint
    from tuner.profiles import layout_key

    probes = []
    for n_layer, n_head, n_embd, vocab in PROBES:
        cfg = gpt2_shape(n_layer, n_head, n_embd, vocab, PROBE_POSITIONS)
        probes.append((cfg, write_random_checkpoint(tmp / f"probe-{n_layer}x{n_embd}", cfg)))
    out = {}
    for tp, pp in layouts_for(base.cores):
        shards = tp * pp
        # one shard: the engine's own choice (every core) unless the profile keeps cores for serving
        threads = base.threads(shards) if shards > 1 or base.serving_cores else 0
        steps, runs = [], []
        # several shards: the first two probes only (the profile's time budget; the served probes
        # then calibrate these layouts on the same two); the vocabulary term needs the third
        for cfg, ckpt in probes if shards == 1 else probes[:2]:
            if cfg.n_head % tp or cfg.n_layer < pp:
                continue
            progress(f"engine steps, TP{tp} PP{pp} ({base.threads(shards)} thread(s) per shard), "
                     f"probe {cfg.n_layer} x {cfg.n_embd}")
            cost = CostModel(cfg, base, tp=tp, pp=pp, weight_dtype=dtype)
            runs.append((cfg, ckpt, cost))
            steps += [(w, dt, cost) for w, dt in engine_steps(ckpt, SCENARIOS, dtype, tp, pp, threads, cfg.vocab_size)]
        if not steps:
            continue
        fit = fit_layout(steps, base.threads(shards), vocab=shards == 1)
        if fit["probe_median_error_pct"] > RETRY_ABOVE_PCT:
            # another process stretched this layout's steps (a shared host): measure it once more and
            # keep the pass the formula describes better; the profile's notes report both
            progress(f"TP{tp} PP{pp}: the fit is {fit['probe_median_error_pct']:.0f}% off its own steps; measuring again")
            again = [(w, dt, cost) for cfg, ckpt, cost in runs
                     for w, dt in engine_steps(ckpt, SCENARIOS, dtype, tp, pp, threads, cfg.vocab_size)]
            fit2 = fit_layout(again, base.threads(shards), vocab=shards == 1)
            other = {id(fit): fit2, id(fit2): fit}
            fit = min(fit, fit2, key=lambda f: f["probe_median_error_pct"])
            fit["retried_from_median_error_pct"] = other[id(fit)]["probe_median_error_pct"]  # the pass not kept
        out[layout_key(tp, pp)] = {k: v if isinstance(v, int) else round(float(v), 4) for k, v in fit.items()}
    return out


DECODE_BATCHES = ((1, 32, 6), (2, 32, 6), (4, 32, 6), (8, 32, 5), (16, 32, 4))
"""(batch, prompt tokens, output tokens) of the one-shard layout's in-process probe (fit_on_engine):
decode steps of 1, 2, 4, 8 and 16 sequences at contexts 33-37, each batch's prefill before them (not
fitted; short prompts for the profile's time budget: a decode step's attention over its context is a
small part of it, and the served decode steps at contexts 97-113 set the level). The served probes' open-loop runs keep 1-5 requests in
flight and meet batches past 1 in a handful of steps each, in bursts of arrivals through the
gateway: until pass 25 a decode step's cost per sequence came from those alone. Since the engine
runs decode batches of 2-64 through one fused C++ call (engines.cpu.fused_decode, main 852545a), a
sequence more costs a fraction of what it did: in one process on this host (one thread) the
6 x 384 probe's decode step is 1.3 / 2.3 / 2.4 / 3.5 / 5.5 ms at 1 / 2 / 4 / 8 / 16 sequences and
the 12 x 768 one's 7.2 / 10.2 / 9.9 / 15.5 / 26.3 ms, where pass 25's served fit gave the default
model (4 x 384) 1.7 / 2.5 / 4.5 / 8.4 / 16.2 ms and GPT-2 12.7 / 14.4 / 19.8 / 30.2 / 50.7 ms; the
simulator then queued at 0.8 x predicted saturation where the engine did not (pass 25: default
model TPOT +106%, GPT-2 +43%). A decode step of 2 sequences or more costs more per layer than the
batch-1 path beyond its rows (decode_batch_layer_us: the 6 x 384 probe 1.3 -> 2.3 ms from 1 to 2
sequences, then 2.4 ms at 4)."""
ENGINE_THREADS = 1
"""Threads of the in-process probe engine: a served one-shard engine on this shared host runs its
steps on one thread mostly (engines.cpu.cpu_threads.AdaptiveThreads; tuner.measure_served.probe_models)."""


def _fitted_times(fit: dict[str, float], rows: list[tuple[object, float, object]]) -> np.ndarray:
    """Seconds the layout constants `fit` give each (StepWork, seconds, CostModel) row."""
    from tuner.cost import CostModel
    from tuner.profiles import layout_key

    out = []
    for w, _, cost in rows:
        key = layout_key(cost.tp, cost.pp)
        prof = cost.profile.replace(layouts={key: {**fit}})
        out.append(CostModel(cost.model, prof, tp=cost.tp, pp=cost.pp, weight_dtype=cost.weight_dtype).step_time(w))
    return np.array(out)


def _lad_line(x: np.ndarray, y: np.ndarray, iterations: int = 20) -> tuple[float, float]:
    """(a, b) >= 0 of y ~ a * x + b by least absolute relative deviations (iteratively reweighted
    non-negative least squares on y's scale): the typical served step, not the mean (fit_layout)."""
    a_mat = np.stack([x, np.ones_like(x)], axis=1)
    wgt = 1.0 / np.maximum(y, 1e-9)
    sol = np.zeros(2)
    for _ in range(iterations):
        sol = nnls(a_mat * wgt[:, None], y * wgt)
        res = np.abs((a_mat @ sol) / y - 1)
        wgt = 1.0 / np.maximum(y, 1e-9) / np.sqrt(np.maximum(res, 0.02))
    return float(sol[0]), float(sol[1])


def fit_on_engine(engine_rows: list[tuple[object, float, object]], served_rows: list[tuple[object, float, object]],
                  threads: int = 1, **kw) -> dict[str, float]:
    """Decode-step constants of a layout (profiles.LAYOUT_DECODE): fit_layout's formula fitted on
    the engine's own decode steps in one process (`engine_rows`: DECODE_BATCHES, batches of 1-16;
    prefill rows are left out), then placed where the served decode steps are (`served_rows`:
    (StepWork, cycle seconds, CostModel), cycles of step + the serving loop's gap; prefill rows are
    left out) by

        served decode step = served_decode_scale * engine decode step + served_step_ms

    fitted by least absolute relative deviations over the served decode steps (probes of four
    sizes: the scale from the deep ones, the per-step cost from the shallow ones). So the cost of a
    sequence more in a decode step comes from batches the engine really ran up to 16, and the level
    from the hundreds of served steps (mostly batch 1: a deployment below saturation runs 1-5
    sequences a step); steps with a prefill chunk keep the served fit. `kw` goes to fit_layout
    (vocab, head, dram). Diagnostics: engine_median_error_pct (the in-process fit on its own steps)
    and probe_* (the placed constants on the served decode steps)."""
    rows = [r for r in engine_rows if not r[0].prefill_attn_pairs]
    if not rows:
        raise ValueError("fit_on_engine: no decode step among the engine's rows")
    fit = fit_layout(rows, threads, prefill=False, multi_row=True, **kw)
    fit["engine_median_error_pct"] = fit.pop("probe_median_error_pct")
    for k in ("probe_steps", "probe_mean_ratio", "probe_max_error_pct"):
        fit.pop(k)
    served = [r for r in served_rows if not r[0].prefill_attn_pairs]
    if not served:
        return fit
    pred = _fitted_times(fit, served)
    meas = np.array([dt for _, dt, _ in served])
    scale, step_s = _lad_line(pred, meas)
    fit.update(served_decode_scale=scale, served_step_ms=step_s * 1e3)
    rel = np.abs((pred * scale + step_s) / meas - 1) * 100
    fit.update(probe_steps=len(served), probe_median_error_pct=float(np.median(rel)),
               probe_mean_ratio=float((pred * scale + step_s).sum() / meas.sum()), probe_max_error_pct=float(rel.max()))
    return {k: v if isinstance(v, int) else float(v) for k, v in fit.items()}


def engine_decode_rows(probes: list[tuple[object, Path, object]], dtype: str,
                       progress=print, threads: int = ENGINE_THREADS) -> list[tuple[object, float, object]]:
    """(StepWork, seconds, CostModel) of every step of DECODE_BATCHES on each (config, checkpoint,
    one-shard CostModel) probe, in this process on `threads` threads (a profile with serving_cores:
    the one-shard engine's fixed count, HardwareProfile.threads(1))."""
    rows = []
    for cfg, ckpt, cost in probes:
        progress(f"engine steps in one process, probe {cfg.n_layer} x {cfg.n_embd} (vocabulary {cfg.vocab_size}): "
                 f"decode batches {', '.join(str(b) for b, _, _ in DECODE_BATCHES)}")
        rows += [(w, dt, cost) for w, dt in engine_steps(ckpt, DECODE_BATCHES, dtype, 1, 1, threads,
                                                          cfg.vocab_size)]
    return rows
