"""The closed loop: serve a candidate with its emitted YAML, load-test it, compare with the prediction.

For each candidate: write its deployment YAML, start `shardserve serve --config` on 127.0.0.1
(tuner.server), warm it up, run one open-loop load test at a fixed share of the predicted
goodput (the accuracy run: predicted and measured TTFT p50, TPOT p50, output throughput and
goodput on the very schedule that was sent), then sweep the request rate with the load tester
(bisection, bounded steps) for the measured goodput. Predictions replay the measured schedule
(scheduled send times, prompt and output lengths) through the simulator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerConfig
from loadtest.config import SLO
from tuner.cost import CostModel, StepWork
from tuner.profiles import HardwareProfile
from tuner.refit import Run
from tuner.search import Candidate, Workload, scheduler_config, sustain_s
from tuner.simulate import simulate

METRICS = ("ttft_p50_ms", "tpot_p50_ms", "output_throughput_tok_s", "goodput_req_s")


@dataclass(frozen=True)
class ValidateSettings:
    """Bounds of one candidate's measurements (each load test is short)."""

    num_prompts: int = 40
    """Requests of the accuracy run and of each sweep step."""
    warmup: int = 4
    accuracy_load: float = 0.6
    """The accuracy run offers this share of the predicted goodput (below saturation)."""
    sweep_steps: int = 10
    sweep_tolerance: float = 0.05
    sweep_min_step_s: float | None = None
    """Each sweep step offers its rate for at least this long (loadtest SweepConfig.min_step_s: its
    request count grows to rate x this); None: tuner.search.sustain_s of the SLOs, as the search
    simulates its goodput. With num_prompts requests per step alone, a step at a rate far past the
    deployment's capacity was a burst of a fraction of a second that a loose TTFT SLO survived: the
    sweep called 10,000 req/s (its max_rate) sustainable on a CPU copy that serves ~40 (session 33,
    BENCHMARKS.md)."""
    startup_timeout_s: float = 240.0
    seed: int = 0
    recalibrate: bool = False
    """Before the candidate's server starts take the host reference (tuner.hostref; with no server
    of ours up, as `tune profile` takes its own) and predict its runs with the profile recalibrated
    to it; the profile's own prediction is kept beside it as "predicted_as_profiled", and references
    taken with the server up (idle) before each run and after it as diagnostics. Needs a profile
    with a host_reference."""


def checkpoint_for(model: ModelConfig, model_path: str | None, work_dir: Path) -> Path:
    """`model_path` if given, else a random-weight checkpoint of `model`'s shape in work_dir
    (timing does not depend on weight values: every request asks for a fixed output length)."""
    if model_path:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model-path: {path} has no config.json (a shardserve checkpoint directory)")
        return path
    from tuner.probe_model import write_random_checkpoint

    out = work_dir / "checkpoint"
    if not (out / "config.json").is_file():
        write_random_checkpoint(out, model)
    return out


def _records(report) -> list:
    return [r for r in report.records if not r.warmup]


def run_of(model: ModelConfig, cand: Candidate, sched: SchedulerConfig, report, extra_tokens: int = 0,
           text_share: float = 1.0) -> Run:
    """A measured load-test run as the refit and the replay need it. `extra_tokens`: what the
    server's tokenizer adds to each prompt (a BOS), which the load tester's counts leave out;
    `text_share`: the share of the checkpoint's token ids with text (Run.text_share)."""
    recs = _records(report)
    return Run(model=model, tp=cand.tp, pp=cand.pp, weight_dtype=cand.weight_dtype, sched=sched, text_share=text_share,
               arrivals=np.array([r.sent_s for r in recs]),
               input_lens=np.array([max(r.input_tokens, 1) + extra_tokens for r in recs]),
               output_lens=np.array([r.requested_output_tokens for r in recs]),
               ttft_s=np.array([r.ttft_s if r.ok else math.nan for r in recs]),
               tpot_s=np.array([r.tpot_s if r.ok else math.nan for r in recs]))


def predict_run(profile: HardwareProfile, run: Run, slos: tuple[SLO, ...],
                step_time: Callable[[StepWork], float] | None = None) -> dict[str, float]:
    """The simulator's TTFT p50, TPOT p50, output throughput and goodput on a measured schedule;
    `step_time` replaces the profile's step model (the profile's request overheads stay)."""
    cost = CostModel(run.model, profile, tp=run.tp, pp=run.pp, weight_dtype=run.weight_dtype)
    base, per_seq = profile.request_overheads_s(run.tp, run.pp)
    traces = simulate(step_time or cost.step_time, run.sched, run.arrivals, run.input_lens, run.output_lens,
                      request_overhead=base, overhead_per_seq=per_seq, text_share=run.text_share)
    return _stats([t.ttft for t in traces], [t.tpot for t in traces],
                  [len(t.token_times) for t in traces], run.arrivals, [t.token_times[-1] for t in traces], slos)


def measured_run(run: Run, report, slos: tuple[SLO, ...]) -> dict[str, float]:
    """The measured counterparts of predict_run. A reply whose every token arrived in one network
    read (a client or gateway descheduled for the whole generation, as on a CI host whose cores its
    test workers share) shows a TPOT of 0, and so does a one-token reply: both still count for goodput
    (the user saw them in time), but neither TPOT is a measurement of the server, so the TPOT p50 leaves
    them out (`tpot_unmeasured` counts them; the p50 is NaN when no reply had one)."""
    recs = _records(report)
    ok = [r.ok for r in recs]
    ends = [r.done_s if r.ok else math.nan for r in recs]
    # no TPOT measured: every token in one read, or a single token (TPOT 0 by vLLM's goodput convention, and left
    # out of the load test's own TPOT statistics, loadtest/metrics.py)
    # (a read of several events gives each a gap of 0 after the first: the reply's first and last text then share
    # one arrival time, and its E2EL equals its TTFT)
    unmeasured = np.array([r.ok and (r.output_tokens <= 1 or not r.e2el_s > r.ttft_s) for r in recs], bool)
    out = _stats(list(run.ttft_s), list(run.tpot_s), [r.output_tokens if o else 0 for r, o in zip(recs, ok, strict=True)],
                 run.arrivals, ends, slos, tpot_shown=np.where(unmeasured, math.nan, run.tpot_s))
    out["tpot_unmeasured"] = int(unmeasured.sum())
    return out


def _stats(ttft, tpot, tokens, arrivals, ends, slos, tpot_shown=None) -> dict[str, float]:
    """Seconds in, ms and per-second out; goodput counts requests within every SLO's bound;
    `tpot_shown`: the TPOTs the p50 is taken over (default `tpot`)."""
    ttft, tpot, ends = np.asarray(ttft, float), np.asarray(tpot, float), np.asarray(ends, float)
    shown = tpot if tpot_shown is None else np.asarray(tpot_shown, float)
    dur = np.nanmax(ends) - np.min(arrivals)
    lim = {s.metric: s.threshold_ms * 1e-3 for s in slos}
    good = np.isfinite(ttft) & (ttft <= lim.get("ttft", math.inf)) & (np.nan_to_num(tpot, nan=math.inf) <= lim.get("tpot", math.inf))
    if "e2el" in lim:
        good &= (ends - np.asarray(arrivals)) <= lim["e2el"]
    return {"ttft_p50_ms": float(np.nanpercentile(ttft, 50) * 1e3),
            "tpot_p50_ms": float(np.nanpercentile(shown, 50) * 1e3) if np.isfinite(shown).any() else math.nan,
            "output_throughput_tok_s": float(np.sum(tokens) / dur),
            "goodput_req_s": float(good.sum() / dur)}


def errors(pred: dict[str, float], meas: dict[str, float]) -> dict[str, float]:
    """Relative error of each prediction against its measurement."""
    return {k: (pred[k] / meas[k] - 1.0) if meas.get(k) else math.nan for k in METRICS}


def measure(cand: Candidate, model: ModelConfig, profile: HardwareProfile, w: Workload, slos: tuple[SLO, ...],
            checkpoint: Path, out_dir: Path, rates: list[float], settings: ValidateSettings | None = None,
            sweep_from: float | None = None, progress=print) -> dict:
    """Serve `cand` from its emitted YAML; one load test per rate in `rates` (each compared with
    the simulator on the schedule actually sent) and, with `sweep_from`, a goodput sweep from there."""
    from loadtest.config import LoadTestConfig, SweepConfig
    from loadtest.runner import run as loadtest_run
    from loadtest.slo_sweep import sweep
    from tuner.emit import deployment, write_yaml
    from tuner.hostref import host_reference, recalibrated, reference_without_server
    from tuner.probe_model import prompt_extra_tokens, text_token_share
    from tuner.server import Server, stopped_sessions

    settings = settings or ValidateSettings()
    out_dir.mkdir(parents=True, exist_ok=True)
    dep = deployment(cand, str(checkpoint.resolve()), profile, name="tuned")
    # every step of a run is kept (not the latest 256) so that served_steps_check sees the whole run
    dep["models"][0]["engine"]["step_record_len"] = RUN_STEPS_KEPT
    yaml_path = write_yaml(dep, out_dir / "deployment.yaml", "written by `shardserve tune search --validate`")
    cost = CostModel(model, profile, tp=cand.tp, pp=cand.pp, weight_dtype=cand.weight_dtype)
    sched = scheduler_config(cand, model, cost, w)
    tok = checkpoint / "tokenizer.json"
    extra = prompt_extra_tokens(tok) if tok.is_file() else 0
    share = text_token_share(tok, model.vocab_size) if tok.is_file() else 1.0
    points, runs, sw = [], [], None
    recal = bool(settings.recalibrate and profile.host_reference)
    # no server of ours up: the last candidate's (if any) has stopped, and its processes have exited
    now = reference_without_server(cache_mib=profile.cache_mib or 32.0, sessions=stopped_sessions()) if recal else {}
    prof = recalibrated(profile, now) if recal else profile
    with Server(["--config", str(yaml_path)], out_dir / "serve.log", settings.startup_timeout_s) as url:
        base = {"url": url, "model": "tuned", "backend": "openai-completions", "arrival": w.arrival,
                "burstiness": w.burstiness, "random_input_len": w.input_len, "random_output_len": w.output_len,
                "ignore_eos": True, "progress": False, "tokenizer": tok if tok.is_file() else None, "slos": slos,
                "seed": settings.seed}
        loadtest_run(LoadTestConfig(**base, request_rate=math.inf, num_prompts=settings.warmup))  # warm-up
        for rate in rates:
            progress(f"  {settings.num_prompts} requests at {rate:.2f} req/s")
            time.sleep(PUSH_WAIT_S)  # the warm-up's (or the last run's) replica metrics reach the hub
            sums0 = replica_latency_sums(url, "tuned")
            served_now = host_reference(cache_mib=profile.cache_mib or 32.0) if recal else {}  # a diagnostic
            t0 = time.monotonic()
            rep = loadtest_run(LoadTestConfig(**base, request_rate=rate, num_prompts=settings.num_prompts))
            run = run_of(model, cand, sched, rep, extra, share)
            pred, meas = predict_run(prof, run, slos), measured_run(run, rep, slos)
            point = {"rate_req_s": rate, "failed": rep.summary.failed, "predicted": pred, "measured": meas,
                     "error": errors(pred, meas)}
            if recal:
                own = predict_run(profile, run, slos)
                point.update(host_reference_now=now, host_reference_served=served_now, host_scale=prof.host_scale,
                             predicted_as_profiled=own, error_as_profiled=errors(own, meas))
            steps = served_steps_check(url, "tuned", t0, CostModel(model, prof, tp=cand.tp, pp=cand.pp,
                                                                    weight_dtype=cand.weight_dtype))
            if recal:  # a diagnostic: the host after the run (not used to predict it)
                point["host_reference_after"] = host_reference(cache_mib=profile.cache_mib or 32.0)
            points.append({**point, "steps": steps,
                           "latency_split": latency_split(sums0, replica_latency_sums(url, "tuned"), run)})
            runs.append(run)
        if sweep_from:
            progress(f"  sweeping the rate from {sweep_from:.2f} req/s for the measured goodput")
            sw = sweep(LoadTestConfig(**base, request_rate=1.0, num_prompts=settings.num_prompts),
                       SweepConfig(start_rate=max(sweep_from, 0.05), tolerance=settings.sweep_tolerance,
                                   max_steps=settings.sweep_steps, min_rate=0.02,
                                   min_step_s=sustain_s(slos) if settings.sweep_min_step_s is None
                                   else settings.sweep_min_step_s))
    out = {"config": {k: v for k, v in cand.__dict__.items() if k != "metrics"},
           "deployment_yaml": str(yaml_path), "points": points}
    if sw is not None:
        out["sweep"] = [{"rate": s.rate, "meets_slo": s.meets_slo, "stopped_early": bool(s.stop_reason),
                         "requests": s.summary.requests, "duration_s": s.summary.duration_s,
                         "ttft_p50_ms": s.summary.ttft_ms.p50, "tpot_p50_ms": s.summary.tpot_ms.p50} for s in sw.steps]
        out["measured_goodput_req_s"] = sw.best_rate or 0.0
        runs += [run_of(model, cand, sched, r, extra, share) for r, s in zip(sw.reports, sw.steps, strict=True)
                 if not s.stop_reason and all(x.ok for x in _records(r))]
    out["n_runs"], out["_runs"] = len(runs), runs
    return out


RUN_STEPS_KEPT = 50_000
"""Steps a validated replica keeps (its engine.step_record_len): more than any run of
ValidateSettings' size takes, so that served_steps_check reads all of a run's steps, not its tail."""
PUSH_WAIT_S = 1.2
"""Seconds for a replica's metrics to reach the gateway's hub (tuner.measure_served.PUSH_INTERVAL_S)."""
_LATENCY_SERIES = {"shardserve_time_to_first_token_seconds": "replica_ttft",
                   "shardserve_request_queue_time_seconds": "engine_queue"}


def replica_latency_sums(url: str, model: str) -> dict[str, float]:
    """The replicas' cumulative TTFT (from a request's arrival at the replica to its first token)
    and engine queue time (from the engine taking it in to its first scheduled step), as
    `GET /metrics` exports them: {"<name>_sum": s, "<name>_count": n}; {} when unreadable."""
    import httpx

    try:
        r = httpx.get(f"{url}/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#") or f'model="{model}"' not in line:
            continue
        name, _, value = line.partition("{")
        for series, key in _LATENCY_SERIES.items():
            for part in ("sum", "count"):
                if name == f"{series}_{part}":
                    out[f"{key}_{part}"] = out.get(f"{key}_{part}", 0.0) + float(value.rsplit(" ", 1)[-1])
    return out


def latency_split(before: dict[str, float], after: dict[str, float], run: Run) -> dict[str, float]:
    """Where one run's mean TTFT went: the client's (load tester) against the replica's own (its
    arrival at the replica to its first token) and the engine's queue time, each the mean over the
    run's requests (the replicas' histogram sums before and after it); the difference between the
    client's and the replica's is the gateway, HTTP and Ray hops both ways."""
    out = {"client_ttft_mean_ms": float(np.nanmean(run.ttft_s) * 1e3)}
    for key in _LATENCY_SERIES.values():
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if n > 0:
            out[f"{key}_mean_ms"] = (after[f"{key}_sum"] - before.get(f"{key}_sum", 0.0)) / n * 1e3
            out[f"{key}_n"] = n
    return out


def served_steps_check(url: str, model: str, since: float, cost: CostModel) -> dict[str, float]:
    """The served replicas' steps of a run (all of them with measure's RUN_STEPS_KEPT, read once
    after it: nothing polls the server while it is measured) against the cost model's step times
    for the same work: how much of a TPOT or TTFT error is the step model's. `raw`: each step cycle
    as [tokens, sampled, prefill attention pairs, decode context, sequences, step seconds, gap
    seconds after it, seconds from `since` to the step's end]."""
    import httpx

    from tuner.measure_served import PUSH_INTERVAL_S, cycle_ends, step_cycles

    time.sleep(max(PUSH_INTERVAL_S + 0.2, PUSH_WAIT_S))  # the replicas publish their windows every metrics push
    try:
        r = httpx.get(f"{url}/v1/admin/steps", params={"model": model}, timeout=30)
        r.raise_for_status()
        windows = r.json()["data"]
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    runs = [[s for s in wdw["steps"] if s["end_s"] > since] for wdw in windows]
    cyc = [c for steps in runs for c in step_cycles(steps)]
    ends = [end - since for steps in runs for end in cycle_ends(steps)]
    if not cyc:
        return {"cycles": 0}
    meas = np.array([dt + gap for _, dt, gap in cyc])
    pred = np.array([cost.step_time(w) for w, _, _ in cyc])
    return {"cycles": len(cyc), "measured_mean_cycle_ms": float(meas.mean() * 1e3),
            "predicted_mean_cycle_ms": float(pred.mean() * 1e3), "median_cycle_error": float(np.median(pred / meas - 1)),
            "mean_gap_ms": float(np.mean([g for _, _, g in cyc]) * 1e3),
            "mean_batch": float(np.mean([w.seqs for w, _, _ in cyc])),
            "raw": [[w.tokens, w.sampled, w.prefill_attn_pairs, w.decode_context, w.seqs, dt, gap, end]
                    for (w, dt, gap), end in zip(cyc, ends, strict=True)],
            # every step of the run, also those after which the engine may have idled (gap_s None), as
            # the route's fields (engines.core.step_record.STEP_FIELDS) with end_s from `since`
            "all": [[s["end_s"] - since, *(v for k, v in s.items() if k != "end_s")] for steps in runs for s in steps]}


def validate_candidate(cand: Candidate, model: ModelConfig, profile: HardwareProfile, w: Workload,
                       slos: tuple[SLO, ...], checkpoint: Path, out_dir: Path,
                       settings: ValidateSettings | None = None, progress=print) -> dict:
    """Serve `cand`: an accuracy run at accuracy_load x its predicted goodput and a goodput sweep."""
    settings = settings or ValidateSettings()
    rate = max(cand.metrics["goodput_req_s"] * settings.accuracy_load, 0.05)
    res = measure(cand, model, profile, w, slos, checkpoint, out_dir, [rate], settings,
                  sweep_from=cand.metrics["goodput_req_s"], progress=progress)
    acc = res.pop("points")[0]
    measured_goodput = res["measured_goodput_req_s"]
    return {**res, "accuracy_rate_req_s": rate, "accuracy_failed": acc["failed"], "predicted": acc["predicted"],
            "measured": acc["measured"],
            "error": acc["error"], "predicted_goodput_req_s": cand.metrics["goodput_req_s"],
            "predicted_goodput_per_device": cand.metrics["goodput_per_device"],
            "measured_goodput_per_device": measured_goodput / cand.metrics["devices"],
            **{k: acc[k] for k in ("host_scale", "error_as_profiled") if k in acc}}
