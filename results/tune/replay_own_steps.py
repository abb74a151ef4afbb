"""Offline, on a saved accuracy pass (session 34): the simulator on each run's schedule with the run's
own served step cycles as its step model (a relative and an absolute line fit, and a table by prefill
or not, tokens and sequences), and each run's TTFT split (the engine side simulated with the table,
the replica's and the client's means from the run's /metrics).

    .venv/bin/python results/tune/replay_own_steps.py pass38
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_tuner import _own_step_features, _run_from_json
from tuner.cost import StepWork
from tuner.measure_engine import nnls
from tuner.profiles import load_profile
from tuner.simulate import simulate
from tuner.validate import errors, predict_run


def step_models(raw: list[list[float]]) -> dict:
    works = [StepWork(*(int(v) for v in s[:5])) for s in raw]
    y = np.array([s[5] + s[6] for s in raw])
    a = np.array([_own_step_features(w) for w in works])
    coef_abs, coef_rel = nnls(a, y), nnls(a / y[:, None], np.ones_like(y))
    table: dict[tuple, list[float]] = {}
    for w, t in zip(works, y, strict=True):
        table.setdefault((bool(w.prefill_attn_pairs), w.tokens, w.seqs), []).append(float(t))
    means = {k: float(np.mean(v)) for k, v in table.items()}

    def line(coef):
        return lambda w: float(np.dot(_own_step_features(w), coef))

    def look(w):
        return means.get((bool(w.prefill_attn_pairs), w.tokens, w.seqs or w.sampled), line(coef_abs)(w))

    return {"rel": line(coef_rel), "abs": line(coef_abs), "table": look}


def main(tag: str) -> None:
    saved = json.loads((ROOT / f"results/tune/accuracy-{tag}.json").read_text())
    prof = load_profile(str(ROOT / f"results/tune/this-machine-{tag}.yaml"))
    for r in saved["rows"]:
        run = _run_from_json(r)
        models = step_models(r["steps"]["raw"])
        errs = {n: errors(predict_run(prof, run, (), step_time=f), r["measured"]) for n, f in models.items()}
        tr = simulate(models["table"], run.sched, run.arrivals, run.input_lens, run.output_lens,
                      request_overhead=0.0, text_share=run.text_share)
        ls = r["latency_split"]
        print(f'{r["model"]:9s} {r["tp"]}x{r["pp"]} {r["rate_req_s"]:6.2f} req/s | '
              + " | ".join(f'{n} TTFT {e["ttft_p50_ms"] * 100:+4.0f}% TPOT {e["tpot_p50_ms"] * 100:+4.0f}%'
                           for n, e in errs.items())
              + f' | engine side {np.mean([t.ttft for t in tr]) * 1e3:6.1f} ms, replica {ls["replica_ttft_mean_ms"]:6.1f},'
              f' client {ls["client_ttft_mean_ms"]:6.1f}')


if __name__ == "__main__":
    main(sys.argv[1])
