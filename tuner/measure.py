"""`shardserve tune profile`: measure this machine into a HardwareProfile YAML (in < 2 minutes).

What is measured, and which profile field it becomes:
- dense matmul rate per dtype, per activation row count and per thread count -> matmul_tflops
  (the cost model interpolates in log(rows) and picks the threads a shard of a layout gets), and
  how a Linear's rate moves with the model's width -> matmul_width_factor;
- read bandwidth of a buffer far past the last-level cache -> hbm_bandwidth_gb_s;
- the last-level cache's size (sysfs) -> cache_mib (a model copy whose weights outgrow it reads them
  from memory at every step: the cost model's weight-streaming term, fitted per layout);
- gloo all-reduce and send/recv between two local processes -> collective_latency_us,
  send_latency_us, intra_node_bandwidth_gb_s (tuner.measure_comm);
- the served engine's own steps, per TP x PP layout of this host: one real `shardserve serve` of
  three random probe checkpoints (depths 2-12, widths 384-768, vocabularies 512-50,257) in every
  layout (several shards as Ray shard actors, as deployments run them), load-tested one request
  at a time, then with Poisson arrivals; every replica's steps come back through `GET /v1/admin/steps`
  and the step formula (step, layer, sequence, vocabulary and attention costs and the engine's
  matmul time against the rate table) is fitted per layout on the served step cycles, a step plus
  the serving loop's gap after it (tuner.measure_served, tuner.measure_engine.fit_layout) ->
  layouts; the one-shard layout's constants are also the global ones; the one-shard copies' TTFT
  one at a time beyond their served prefill cycle -> request_overhead_ms.
  With --no-serve the same formula is fitted on the engine's steps in isolation instead (each
  layout's executor without Ray or a gateway; tuner.measure_engine).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import engines  # noqa: F401 - before torch: libgomp's wait policy (engines.cpu.cpu_threads) as the served engine has it
from engines.cpu.cpu_threads import host_cores
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


def last_level_cache_mib(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> float:
    """Size (MiB) of the largest cache level cpu0 sees (Linux sysfs: index*/level, index*/size such
    as "32768K"); 0 where sysfs does not say (the cost model then has no cache term)."""
    best_level, best = 0, 0.0
    for idx in sorted(root.glob("index*")):
        try:
            level = int((idx / "level").read_text().strip())
            size = (idx / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(size[-1:], None)
        num = size[:-1] if mult is not None else size
        if not num.isdigit():
            continue
        mib = int(num) * (mult if mult is not None else 1 / 2**20)
        if level > best_level or (level == best_level and mib > best):
            best_level, best = level, mib
    return round(best, 3)


def measure(name: str = "this-machine", serve: bool = True, progress: Callable[[str], None] = print,
            dtype: str = "auto", steps_out: Path | None = None, serving_cores: int = 0) -> HardwareProfile:
    """Measure this machine; `serve=False` skips the gateway probe (request_overhead_ms stays 0);
    `steps_out`: a JSON file for the served probes' steps (what the fit saw).
    The engine constants are fitted on steps in `dtype` ("auto": what the engine picks here, bf16
    on CPUs with AMX or AVX512-BF16, else float32), the dtype the profile's configs should serve in.
    `serving_cores`: HardwareProfile.serving_cores (below the host's cores)."""
    import torch

    from engines.core.config import EngineConfig, resolved_dtype
    from tuner.hostref import combine, host_reference
    from tuner.measure_comm import measure_gloo
    from tuner.measure_engine import measure_layouts

    dtype = resolved_dtype(EngineConfig(dtype=dtype))
    t_start = time.perf_counter()
    cores = host_cores()
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
        send_latency_us=round(comm["send_latency_us"], 1), reserved_memory_gib=1.0,
        cache_mib=last_level_cache_mib(), serving_cores=serving_cores)
    with tempfile.TemporaryDirectory(prefix="shardserve-profile-") as tmp:
        if serve:
            layouts, request_ms, notes, refs = _served(base, Path(tmp), dtype, progress, steps_out)
        else:
            refs = [host_reference(cache_mib=base.cache_mib or 32.0)]
            layouts, request_ms = measure_layouts(base, Path(tmp), dtype, progress), 0.0
            refs.append(host_reference(cache_mib=base.cache_mib or 32.0))
            notes = "the engine's steps in isolation (--no-serve: no request overhead, no serving loop)"
    one = layouts["1x1"]
    errs = ", ".join(f"{k} {v['probe_median_error_pct']:.0f}% (max {v['probe_max_error_pct']:.0f}%"
                     + (f"; measured twice, the other pass {v['retried_from_median_error_pct']:.0f}%"
                        if "retried_from_median_error_pct" in v else "") + ")"
                     for k, v in layouts.items())
    prof = base.replace(layouts=layouts, request_overhead_ms=round(float(request_ms), 3), host_reference=combine(refs),
                        **{k: one[k] for k in ("step_overhead_ms", "layer_overhead_us", "seq_overhead_us",
                                               "seq_layer_overhead_us", "attention_prefill_tflops",
                                               "attention_kv_gb_s")},
                        fit_notes=(f"measured by `shardserve tune profile` in {time.perf_counter() - t_start:.0f} s "
                                   f"on {cores} CPUs (torch {torch.__version__}); per-layout step constants "
                                   f"fitted on {dtype} {notes} (median / max error of the fit on its own steps: "
                                   f"{errs}); request overhead {request_ms:.1f} ms"))
    return prof


def _served(base: HardwareProfile, tmp: Path, dtype: str, progress: Callable[[str], None],
            steps_out: Path | None = None) -> tuple[dict[str, dict[str, float]], float, str, list[dict]]:
    """Serve the probes in every layout of this host and fit each layout's constants on its served
    step cycles (tuner.measure_served); (layouts, request_overhead_ms, a note for fit_notes, the host
    references taken before and after the probe server: tuner.hostref)."""
    import numpy as np

    from engines.core.scheduler import SchedulerConfig
    from tuner.cost import CostModel
    from tuner.measure_engine import PROBE_POSITIONS, fit_layout, layouts_for
    from tuner.measure_served import (
        MULTI_SHARD_PROBES,
        PROBE_MAX_BATCHED_TOKENS,
        PROBE_MAX_NUM_SEQS,
        SERVED_PROBES,
        open_loop_run,
        overhead_per_seq_s,
        request_overheads_s,
        requests_of,
        serve_probes,
        step_cycles,
    )
    from tuner.probe_model import gpt2_shape, prompt_extra_tokens, write_random_checkpoint
    from tuner.profiles import LAYOUT_DECODE, layout_key

    probes = []
    for n_layer, n_head, n_embd, vocab in SERVED_PROBES:
        cfg = gpt2_shape(n_layer, n_head, n_embd, vocab, PROBE_POSITIONS)
        probes.append((cfg, write_random_checkpoint(tmp / f"probe-{n_layer}x{n_embd}", cfg)))
    copies, meta = {}, {}
    for tp, pp in layouts_for(base.cores):
        for i, (cfg, path) in enumerate(probes):
            if cfg.n_head % tp or cfg.n_layer < pp or (tp * pp > 1 and i not in MULTI_SHARD_PROBES):
                continue
            name = f"p{i}-{layout_key(tp, pp)}"
            copies[name] = (path, tp, pp)
            meta[name] = (layout_key(tp, pp), CostModel(cfg, base, tp=tp, pp=pp, weight_dtype=dtype))
    from tuner.hostref import host_reference, reference_without_server
    from tuner.measure_engine import ENGINE_THREADS, engine_decode_rows, fit_on_engine

    # the one-shard layout's decode batches of 1-16 in this process, before any server of ours is up
    # (tuner.measure_engine.DECODE_BATCHES: the served probes meet batches past 1 in a handful of
    # steps each; fit_on_engine places them at the served steps' level)
    engine_rows = engine_decode_rows([(cfg, path, CostModel(cfg, base, weight_dtype=dtype)) for cfg, path in probes],
                                     dtype, progress, threads=base.threads(1) if base.serving_cores else ENGINE_THREADS)

    def reference() -> dict:
        return host_reference(cache_mib=base.cache_mib or 32.0)

    # the host reference with no server of ours up, before the probes and after them (as bench_tuner
    # and `--recalibrate` take theirs: passes 21-22 took it with the probe server up, and the idle
    # eight-copy server slowed it 10-20% where it did not slow the probes' steps alike)
    refs = [reference()]
    progress(f"served probes: `shardserve serve` of {len(copies)} copies ({', '.join(copies)}), load tester requests")
    served = serve_probes(copies, tmp, dtype, base, progress, reference=reference)
    served_ref = served.pop("_host_reference")[0]
    layouts: dict[str, dict[str, float]] = {}
    notes = []
    for key in dict.fromkeys(k for k, _ in meta.values()):
        rows, gaps = [], []
        for name, (k, cost) in meta.items():
            if k == key:
                cyc = step_cycles(served[name]["steps"])
                rows += [(w, dt + gap, cost) for w, dt, gap in cyc]
                gaps += [gap for _, _, gap in cyc]
        tp, pp = (int(v) for v in key.split("x"))
        # several shards see two probes, which cannot tell the vocabulary's per-sequence cost from the
        # other per-sequence costs: it is the one-shard layout's, per entry of a shard's slice (one
        # thread there too: the one-shard engine's adaptive chooser runs its steps on one thread on a
        # host this busy; until pass 15, when the probes fixed two threads, it was scaled by the threads)
        one = layouts.get("1x1", {})
        vocab = True if tp * pp == 1 else one["vocab_seq_ns"]
        # likewise the LM head's per-step cost (two probes' heads are 0.4M and 3.1M entries): the one-shard layout's
        head = True if tp * pp == 1 else one["head_ns"]
        # and the rate of reading weights past the cache, a property of the host's memory: of the two
        # probes only one outgrows the cache, so its depth and its bytes cannot be told apart (pass 15:
        # the 1x2 fit read 8.8 GB/s, and charged GPT-2's 77 MB head at it); the one-shard layout's four tell
        dram = True if tp * pp == 1 else (1e-9 / one["dram_weight_gb_s"] if one.get("dram_weight_gb_s") else False)
        # the typical served step, not the mean (fit_layout's docstring): the probes' slow steps
        # (young thread choosers, burst arrivals) are not the share a deployment serving for minutes runs
        fit = fit_layout(rows, base.threads(tp * pp), vocab=vocab, mean=False, head=head, dram=dram)
        fit["served_gap_ms"] = float(np.median(gaps)) * 1e3
        layouts[key] = {k: v if isinstance(v, int) else round(float(v), 4) for k, v in fit.items()}
        if tp * pp == 1:  # its decode steps: the engine's own batches of 1-16, at the served level
            dec = fit_on_engine(engine_rows, rows, base.threads(1))
            layouts[key][LAYOUT_DECODE] = {k: v if isinstance(v, int) else round(float(v), 4) for k, v in dec.items()}
            progress(f"served {key} decode steps: the engine's decode batches 1-16 in one process fitted "
                     f"(median error {dec['engine_median_error_pct']:.1f}%), x {dec['served_decode_scale']:.3f} + "
                     f"{dec['served_step_ms']:.3f} ms on the served decode cycles (median error "
                     f"{dec.get('probe_median_error_pct', float('nan')):.1f}%)")
        notes.append(f"{key} {len(rows)} cycles, median gap {fit['served_gap_ms']:.2f} ms")
        progress(f"served {key}: {len(rows)} step cycles, fit median / max error "
                 f"{fit['probe_median_error_pct']:.1f}% / {fit['probe_max_error_pct']:.0f}%, "
                 f"fitted / measured total {fit['probe_mean_ratio']:.3f}, "
                 f"median gap between steps {fit['served_gap_ms']:.2f} ms")
    # the median over every one-shard copy's requests: a probe whose tokenizer makes the gateway slow
    # (the 50,257-entry vocabulary's random tokenizer) is one copy among three
    own = {name: request_overheads_s(served[name]["runs"][1], served[name]["steps"], served[name]["spans"][1])
           for name in meta}
    over = [o for name, (key, _) in meta.items() if key == "1x1" for o in own[name]]
    request_ms = max(float(np.median(over)), 0.0) * 1e3
    # under load: the overhead per sequence the engine holds when a request arrives, per layout, from
    # the open-loop runs simulated with the layout's fitted steps (each copy with its own overhead
    # one at a time, so that a copy's constant, such as a slow tokenizer, stays out of it). Kept as
    # a diagnostic only (served_overhead_per_seq_ms), not used to predict: in passes 15-17 it came
    # out 0.9-8.3 ms per sequence with the probes' own TTFTs still 12-35% off (mean |log|), while the
    # gateway's legs of the accuracy runs' TTFT grew by 1-9 ms under load in all (BENCHMARKS.md)
    fitted = base.replace(layouts=layouts)
    for key, layout in layouts.items():
        runs = []
        for name, (k, cost) in meta.items():
            if k != key:
                continue
            ckpt = copies[name][0]
            arr, il, ol, ttft = open_loop_run(served[name]["runs"]["open"].records,
                                              prompt_extra_tokens(ckpt / "tokenizer.json"))
            max_len = int(il.max() + ol.max() + 1)
            cfg = SchedulerConfig(max_num_seqs=PROBE_MAX_NUM_SEQS, max_num_batched_tokens=PROBE_MAX_BATCHED_TOKENS,
                                  block_size=16, num_blocks=PROBE_MAX_NUM_SEQS * (-(-max_len // 16) + 1),
                                  max_model_len=max_len)
            step = CostModel(cost.model, fitted, tp=cost.tp, pp=cost.pp, weight_dtype=cost.weight_dtype).step_time
            runs.append((step, cfg, arr, il, ol, ttft, max(float(np.median(own[name])), 0.0)))
        per_seq, loss = overhead_per_seq_s(runs)
        layout["served_overhead_per_seq_ms"] = round(per_seq * 1e3, 3)
        layout["served_ttft_log_error"] = round(loss, 4)
        progress(f"served {key}: request overhead {per_seq * 1e3:.2f} ms per sequence held at arrival would fit "
                 f"the open-loop TTFTs best (mean |log(simulated / measured)| {loss:.3f}; a diagnostic, not used)")
    if steps_out is not None:  # what the fit saw, for a refit or a look without serving again
        steps_out.write_text(json.dumps({name: {"layout": meta[name][0], "probe": list(SERVED_PROBES[int(name[1])]),
                                                "steps": served[name]["steps"],
                                                "ttft_one_at_a_time_s": [float(x) for x in requests_of(
                                                    served[name]["runs"][1])["ttft"]],
                                                "span_one_at_a_time": served[name]["spans"][1],
                                                # the open-loop run as sent and as measured: the request
                                                # overhead under load can be studied without serving again
                                                "open_loop": [[r.sent_s, r.input_tokens, r.requested_output_tokens,
                                                               r.output_tokens, r.ttft_s if r.ok else None,
                                                               r.tpot_s if r.ok else None]
                                                              for r in served[name]["runs"]["open"].records
                                                              if not r.warmup],
                                                "span_open_loop": served[name]["spans"]["open"]}
                                         for name in served}))
    if steps_out is not None:  # and the one-shard decode batches in one process (fit_on_engine's rows)
        engine_out = steps_out.with_name(steps_out.name.removesuffix(".json") + ".engine.json")
        engine_out.write_text(json.dumps([[[c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.vocab_size],
                                           dataclasses.asdict(w), dt] for w, dt, c in engine_rows]))
    # the probe server is gone: its Ray processes exit while the fits run (at most 5 s more of waiting)
    refs.append(reference_without_server(max_wait_s=5.0, cache_mib=base.cache_mib or 32.0))
    progress("host reference without a server (before, after the probes): "
             + ", ".join(f"{r['decode_us']:.0f} us a decode, {r['read_gb_s']:.1f} GB/s" for r in refs)
             + f"; with the probe server up (idle): {served_ref['decode_us']:.0f} us, {served_ref['read_gb_s']:.1f} GB/s")
    refs[0] = {**refs[0], "served_decode_us": served_ref["decode_us"], "served_read_gb_s": served_ref["read_gb_s"]}
    return (layouts, request_ms, "served step cycles (step + the serving loop's gap after it; " + "; ".join(notes) + ")",
            refs)
