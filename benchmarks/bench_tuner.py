"""Tuner accuracy on this machine: predicted against measured TTFT p50, TPOT p50 and output
throughput for layouts of the default model's shape and a GPT-2-124M-shaped model.

Each layout is served by `shardserve serve --config` with the YAML the tuner emits (random
weights of the model's shape: requests ask for a fixed number of tokens, so timing does not
depend on the weights) and load-tested open loop at shares of its predicted saturation rate; the
simulator replays the schedule actually sent. Prints one markdown row per (layout, rate), each
metric as predicted / measured (error), and how many are within the target.

    flock /tmp/shardserve-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tuner.py \
        --hardware runs/tune/this-machine.yaml --out /tmp/bench-tuner
    # the closed loop's refit, held out per layout, from the saved requests (no lock: nothing timed)
    env PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tuner.py --hardware runs/tune/this-machine.yaml \
        --from-json /tmp/bench-tuner/accuracy.json --refit --out /tmp/bench-tuner-refit
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerConfig
from tuner.cost import CostModel, StepWork, static_batch
from tuner.hostref import recalibrated
from tuner.measure_engine import nnls
from tuner.probe_model import gpt2_shape
from tuner.profiles import load_profile
from tuner.refit import Run, refit
from tuner.search import Candidate, Workload, scheduler_config
from tuner.validate import ValidateSettings, checkpoint_for, errors, measure, predict_run

MODELS = {
    # the default model (recipes/default.yaml; vocabulary of `shardserve data`'s tokenizer)
    "default": gpt2_shape(4, 6, 384, vocab_size=8192, positions=256),
    "gpt2-124m": gpt2_shape(12, 12, 768, vocab_size=50257, positions=1024),
}
# (model, tp, pp, max_num_seqs, shares of the predicted saturation rate): below saturation and near it
LAYOUTS = [
    ("default", 1, 1, 16, (0.4, 0.8)),
    ("default", 2, 1, 16, (0.6,)),
    ("default", 1, 2, 16, (0.8,)),
    ("gpt2-124m", 1, 1, 8, (0.4, 0.8)),
    ("gpt2-124m", 2, 1, 8, (0.8,)),
    ("gpt2-124m", 1, 2, 4, (0.6,)),
]
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "output_throughput_tok_s")


@functools.cache
def _probe_text_share(vocab_size: int) -> float:
    """Share of token ids with text of the random checkpoint checkpoint_for writes for a model of
    `vocab_size` ids (its tokenizer is tuner.probe_model.write_tokenizer's, trained the same way
    each time): for rows saved before accuracy.json recorded it (passes <= 18)."""
    import tempfile

    from tuner.probe_model import text_token_share, write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp), vocab_size=min(512, vocab_size))
        return text_token_share(Path(tmp) / "tokenizer.json", vocab_size)


def _run_from_json(r: dict) -> Run:
    """The measured run of a saved row (accuracy.json), for a refit without serving again."""
    q = r["requests"]
    arr = {k: np.array([math.nan if v is None else v for v in q[k]], dtype=float) for k in q}
    model = MODELS[r["model"]]
    share = r["text_share"] if "text_share" in r else _probe_text_share(model.vocab_size)
    return Run(model=model, tp=r["tp"], pp=r["pp"], weight_dtype=r.get("weight_dtype", "bfloat16"),
               sched=SchedulerConfig(**r["scheduler"]), arrivals=arr["arrivals"],
               input_lens=arr["input_lens"].astype(int), output_lens=arr["output_lens"].astype(int),
               ttft_s=arr["ttft_s"], tpot_s=arr["tpot_s"], text_share=share)


def _sched_of(r: dict, profile, args) -> SchedulerConfig:
    """The simulator's scheduler limits of a saved row's layout, as _measure derives them."""
    model = MODELS[r["model"]]
    seqs = r["max_num_seqs"]
    cand = Candidate(r["tp"], r["pp"], 1, seqs, max(seqs * args.input_len, 512), r.get("weight_dtype", args.dtype))
    cost = CostModel(model, profile, tp=r["tp"], pp=r["pp"], weight_dtype=cand.weight_dtype)
    return scheduler_config(cand, model, cost, Workload(args.input_len, args.output_len, args.num_prompts))


def _measure(args, profile) -> tuple[list[dict], dict]:
    w = Workload(args.input_len, args.output_len, args.num_prompts)
    layouts = [x for i, x in enumerate(LAYOUTS) if not args.only or str(i) in args.only.split(",")]
    cpu = subprocess.run(["bash", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    env = {"cpu": cpu.stdout.strip() or platform.processor(), "avx512_bf16": "avx512_bf16" in flags,
           "load_before": Path("/proc/loadavg").read_text().split()[:3], "dtype": args.dtype,
           "hardware": str(args.hardware), "profile_notes": profile.fit_notes, "num_prompts": args.num_prompts}
    print(f"# {env}")
    rows, t0 = [], time.perf_counter()
    for name, tp, pp, seqs, shares in tqdm(layouts, desc="layouts"):
        model: ModelConfig = MODELS[name]
        cand = Candidate(tp, pp, 1, seqs, max(seqs * args.input_len, 512), args.dtype)
        cost = CostModel(model, profile, tp=tp, pp=pp, weight_dtype=args.dtype)
        # predicted saturation: a full batch of max_num_seqs requests, start to last token
        sat = seqs / (static_batch(cost, seqs, args.input_len, args.output_len)["latency_ms"] / 1e3)
        ckpt = checkpoint_for(model, None, args.out / f"ckpt-{name}")
        rates = [max(s * sat, args.num_prompts / args.max_run_s) for s in shares]
        load = Path("/proc/loadavg").read_text().split()[:3]
        res = measure(cand, model, profile, w, (), ckpt, args.out / f"{name}-tp{tp}-pp{pp}-s{seqs}",
                      rates, ValidateSettings(num_prompts=args.num_prompts, recalibrate=args.recalibrate),
                      progress=lambda m: tqdm.write(m))
        load_end = Path("/proc/loadavg").read_text().split()[:3]
        for pt, run in zip(res["points"], res["_runs"], strict=True):
            rows.append({"model": name, "tp": tp, "pp": pp, "max_num_seqs": seqs, "weight_dtype": args.dtype, **pt,
                         "predicted_saturation_req_s": sat, "share_of_predicted_saturation": pt["rate_req_s"] / sat,
                         "load_start": load, "load_end": load_end, "_run": run,
                         "profile_host_reference": profile.host_reference})
    env["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    env["elapsed_s"] = time.perf_counter() - t0
    for r in rows:  # the measured requests, so that a refit can be redone offline (--from-json)
        run = r["_run"]
        r["requests"] = {k: [None if math.isnan(v) else float(v) for v in getattr(run, k)]
                         for k in ("arrivals", "input_lens", "output_lens", "ttft_s", "tpot_s")}
        r["scheduler"] = {k: getattr(run.sched, k) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                             "num_blocks", "max_model_len")}
        r["text_share"] = run.text_share
    return rows, env


def _own_step_features(w: StepWork) -> list[float]:
    pre = bool(w.prefill_attn_pairs)
    return [float(not pre), float(pre), 0.0 if pre else w.tokens, w.tokens if pre else 0.0,
            w.decode_context / 1e3, w.prefill_attn_pairs / 1e4]


def own_steps_prediction(profile, run: Run, raw: list[list[float]]) -> dict[str, float] | None:
    """The simulator on the run's schedule with the run's own served steps as its step model (a
    line per kind of step, decode-only and with a prefill chunk, in tokens, context and attention
    pairs, fitted on every step cycle of the run, relative errors): what the profile's prediction
    would be with a step model right on average, so that a miss splits into the step model's part
    and the rest's (request overheads, scheduling, streaming). None without the run's steps."""
    if len(raw) < 20:
        return None
    works = [StepWork(*(int(v) for v in s[:5])) for s in raw]
    y = np.array([s[5] + s[6] for s in raw])
    a = np.array([_own_step_features(w) for w in works])
    coef = nnls(a / y[:, None], np.ones_like(y))
    return predict_run(profile, run, (), step_time=lambda w: float(np.dot(_own_step_features(w), coef)))


def _report(rows: list[dict], target: float) -> None:
    for pred, err, title in (("predicted_as_profiled", "error_as_profiled",
                              "profile as measured by `tune profile`, not recalibrated"),
                             ("predicted", "error", "profile as measured by `tune profile`"
                              + (", recalibrated to the host's state before each run (tuner.hostref)"
                                 if any("host_scale" in r for r in rows) else "")),
                             ("refit_predicted", "refit_error", "refitted on the other layouts' runs (held out)")):
        sel = [r for r in rows if err in r]
        if not sel:
            continue
        ok = [all(abs(r[err][k]) <= target for k in METRICS) for r in sel]
        print(f"\n{title}: predicted / measured (error)\n")
        print(f"| model | TP | PP | max_num_seqs | rate req/s (x pred. sat.) | {' | '.join(METRICS)} | load 1-min |")
        print("|---|---|---|---|---|" + "---|" * len(METRICS) + "---|")
        for r in sel:
            cells = " | ".join(f"{r[pred][k]:.1f} / {r['measured'][k]:.1f} ({r[err][k]:+.1%})" for k in METRICS)
            print(f"| {r['model']} | {r['tp']} | {r['pp']} | {r['max_num_seqs']} | {r['rate_req_s']:.2f} "
                  f"({r['share_of_predicted_saturation']:.2f}) | {cells} | {r['load_start'][0]} -> {r['load_end'][0]} |")
        if pred == "predicted" and any("host_scale" in r for r in sel):
            print("\nthe host reference (tuner.hostref: decode_us, read GB/s) of the profile; of each layout before its "
                  "server starts (used), with the server up before the run and after it (diagnostics) -> the scales "
                  "applied (cpu, memory)\n")
            print(f"- profile: {json.dumps(rows[0].get('profile_host_reference', {}))}")
            for r in sel:
                if "host_scale" in r:
                    b, a = r["host_reference_now"], r.get("host_reference_after", {})
                    sv = r.get("host_reference_served", {})
                    print(f"- {r['model']} TP{r['tp']} PP{r['pp']} at {r['rate_req_s']:.2f} req/s: no server "
                          f"{b['decode_us']:.0f} us, {b['read_gb_s']:.1f} GB/s (steal {b.get('steal_pct', 0):.1f}%); "
                          f"server up {sv.get('decode_us', float('nan')):.0f} us, {sv.get('read_gb_s', float('nan')):.1f} GB/s; "
                          f"after {a.get('decode_us', float('nan')):.0f} us, {a.get('read_gb_s', float('nan')):.1f} GB/s"
                          f" -> cpu x{r['host_scale']['cpu']:.3f}, memory x{r['host_scale']['memory']:.3f}")
        if pred == "predicted" and any(r.get("steps", {}).get("cycles") for r in sel):
            print("\nthe run's own served steps (every step of it since pass 31, read after it; before, the last "
                  "~250): mean step cycle (step + the gap after it) predicted / measured, the median per-step "
                  "error, mean batch, mean gap\n")
            for r in sel:
                st = r.get("steps", {})
                if st.get("cycles"):
                    print(f"- {r['model']} TP{r['tp']} PP{r['pp']} at {r['rate_req_s']:.2f} req/s: "
                          f"{st['predicted_mean_cycle_ms']:.2f} / {st['measured_mean_cycle_ms']:.2f} ms "
                          f"({st['median_cycle_error']:+.1%} median over {st['cycles']} steps), batch "
                          f"{st['mean_batch']:.1f}, gap {st['mean_gap_ms']:.2f} ms")
        if pred == "predicted" and any("own_steps_error" in r for r in sel):
            print("\nthe simulator with each run's own served steps as its step model (tokens, context and "
                  "attention pairs fitted on every step of the run; the profile's request overheads): TTFT p50 and "
                  "TPOT p50 predicted / measured (error); what is left when the step model is right on average\n")
            for r in sel:
                if "own_steps_error" in r:
                    o, e = r["own_steps_predicted"], r["own_steps_error"]
                    print(f"- {r['model']} TP{r['tp']} PP{r['pp']} at {r['rate_req_s']:.2f} req/s: TTFT "
                          f"{o['ttft_p50_ms']:.1f} / {r['measured']['ttft_p50_ms']:.1f} ({e['ttft_p50_ms']:+.1%}), TPOT "
                          f"{o['tpot_p50_ms']:.2f} / {r['measured']['tpot_p50_ms']:.2f} ({e['tpot_p50_ms']:+.1%})")
        if pred == "predicted" and any(r.get("latency_split", {}).get("replica_ttft_mean_ms") for r in sel):
            print("\nwhere the measured TTFT goes (means over each run's requests): the client's, the replica's "
                  "own (arrival at the replica to its first token), the engine's queue (taken in to first step)\n")
            for r in sel:
                ls = r.get("latency_split", {})
                if ls.get("replica_ttft_mean_ms"):
                    print(f"- {r['model']} TP{r['tp']} PP{r['pp']} at {r['rate_req_s']:.2f} req/s: client "
                          f"{ls['client_ttft_mean_ms']:.1f} ms, replica {ls['replica_ttft_mean_ms']:.1f} ms, engine queue "
                          f"{ls.get('engine_queue_mean_ms', float('nan')):.1f} ms")
        worst = {k: max(abs(r[err][k]) for r in sel) for k in METRICS}
        per = {k: sum(abs(r[err][k]) <= target for r in sel) for k in METRICS}
        print(f"\n{sum(ok)}/{len(sel)} configurations within {target:.0%} on all three metrics; per metric "
              + ", ".join(f"{k} {v}/{len(sel)}" for k, v in per.items()) + "; worst |error| "
              + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", required=True, help="profile measured here by `shardserve tune profile`")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-run-s", type=float, default=150.0,
                    help="raise a rate that would make one load test longer than this (s) to num_prompts / max_run_s")
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype (the profile's rates for it are used)")
    ap.add_argument("--only", default="", help="comma-separated layout indexes to run (default: all)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_tuner"))
    ap.add_argument("--target", type=float, default=0.10)
    ap.add_argument("--refit", action="store_true", help="also the closed loop's refit, held out per layout "
                    "(CPU work after the measurements: run it with --from-json outside the bench lock)")
    ap.add_argument("--from-json", type=Path, default=None, help="an accuracy.json of an earlier run: report "
                    "(and with --refit, refit) without serving anything")
    ap.add_argument("--recalibrate", action="store_true", help="before each run take the host reference "
                    "(tuner.hostref) and predict with the profile recalibrated to it (the profile's own prediction "
                    "is reported too)")
    ap.add_argument("--repredict", action="store_true", help="with --from-json: predict the saved runs with "
                    "--hardware (another profile) instead of reporting the saved predictions")
    args = ap.parse_args()
    profile = load_profile(args.hardware)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        rows, env = saved["rows"], saved["env"]
        for r in rows:
            r["_run"] = _run_from_json(r)
            for k in ("refit_predicted", "refit_error"):
                r.pop(k, None)
            if args.repredict:  # the given profile's predictions on the saved schedules
                # with the scheduler limits this code derives (they are the simulator's, not measured)
                r["_run"] = replace(r["_run"], sched=_sched_of(r, profile, args))
                r["scheduler"] = {k: getattr(r["_run"].sched, k) for k in r["scheduler"]}
                prof = profile
                if r.get("host_reference_now") and profile.host_reference:  # as the run was predicted
                    prof = recalibrated(profile, r["host_reference_now"])
                    r["host_scale"], r["profile_host_reference"] = prof.host_scale, profile.host_reference
                    r["predicted_as_profiled"] = predict_run(profile, r["_run"], ())
                    r["error_as_profiled"] = errors(r["predicted_as_profiled"], r["measured"])
                r["predicted"] = predict_run(prof, r["_run"], ())
                r["error"] = errors(r["predicted"], r["measured"])
        print(f"# {env}")
    else:
        rows, env = _measure(args, profile)
    if args.refit:  # each layout predicted by a profile refitted on the other layouts' runs
        for r in tqdm(rows, desc="held-out refits"):
            key = (r["model"], r["tp"], r["pp"])
            others = [o["_run"] for o in rows if (o["model"], o["tp"], o["pp"]) != key]
            if others:
                fitted, _ = refit(profile, others, polish=40)
                r["refit_predicted"] = predict_run(fitted, r["_run"], ())
                r["refit_error"] = errors(r["refit_predicted"], r["measured"])
    for r in rows:  # every step of the run is saved since pass 31 (tuner.validate.RUN_STEPS_KEPT)
        own = own_steps_prediction(profile, r["_run"], r.get("steps", {}).get("raw", []))
        if own is not None:
            r["own_steps_predicted"], r["own_steps_error"] = own, errors(own, r["measured"])
    _report(rows, args.target)
    print(f"# load before {env['load_before']}, after {env['load_after']}, {env['elapsed_s']:.0f} s of measurement")
    args.out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("_run")
    # compact: with every step of every run (tuner.validate.served_steps_check) a pass is megabytes indented
    (args.out / "accuracy.json").write_text(json.dumps({"env": env, "rows": rows}, separators=(",", ":")))


if __name__ == "__main__":
    main()
