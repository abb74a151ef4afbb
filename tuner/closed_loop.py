"""`shardserve tune search --validate K`: serve the top K candidates, measure, refit, re-rank.

The report (validation.json, validation.png) goes to the search's result directory:
predicted against measured for every validated candidate, the measured goodput sweep, the
refitted profile (refit.yaml) and the candidates re-ranked with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from engines.core.config import ModelConfig
from loadtest.config import SLO
from tuner.profiles import HardwareProfile
from tuner.refit import refit
from tuner.search import Candidate, Workload, evaluate, rank
from tuner.validate import METRICS, ValidateSettings, checkpoint_for, errors, predict_run, validate_candidate


def closed_loop(ranked: list[Candidate], k: int, model: ModelConfig, profile: HardwareProfile, w: Workload,
                slos: tuple[SLO, ...], objective: str, out: Path, model_path: str | None = None,
                settings: ValidateSettings | None = None, progress=print) -> dict:
    """Validate ranked[:k] on real servers; returns (and writes) the report."""
    settings = settings or ValidateSettings()
    if k < 1:
        raise ValueError(f"--validate: must be >= 1, got {k}")
    picked = ranked[:k]
    ckpt = checkpoint_for(model, model_path, out / "validate")
    results = []
    for i, cand in enumerate(picked):
        progress(f"[{i + 1}/{len(picked)}] serving tp={cand.tp} pp={cand.pp} replicas={cand.replicas} "
                 f"max_num_seqs={cand.max_num_seqs} max_num_batched_tokens={cand.max_num_batched_tokens} "
                 f"{cand.weight_dtype}")
        results.append(validate_candidate(cand, model, profile, w, slos, ckpt, out / "validate" / f"c{i}",
                                          settings, progress))
    runs = [r for res in results for r in res.pop("_runs")]
    best = max(res["measured_goodput_per_device"] for res in results)
    pick = results[0]["measured_goodput_per_device"]
    # refit on everything measured, re-predict the accuracy runs, re-rank the searched candidates
    fitted, factors = refit(profile, runs, polish=60)
    fitted.save(out / "refit.yaml")
    acc_runs = _accuracy_runs(runs, results)
    for res, run in zip(results, acc_runs, strict=True):
        res["refit_predicted"] = predict_run(fitted, run, slos)
        res["refit_error"] = errors(res["refit_predicted"], res["measured"])
    reranked = rank(evaluate(model, fitted, [replace(c, metrics={}) for c in ranked], w, slos), objective)
    report = {
        "objective": objective, "slos": [s.key for s in slos], "workload": w.__dict__,
        "checkpoint": str(ckpt), "candidates": results,
        "pick_measured_goodput_per_device": pick, "best_measured_goodput_per_device": best,
        "pick_within_pct_of_best": (1 - pick / best) * 100 if best > 0 else math.nan,
        "refit_factors": {c: (None if math.isinf(v) else v) for c, v in factors.items()},
        "reranked_top": [{k: v for k, v in c.__dict__.items() if k != "metrics"}
                         | {"goodput_per_device": c.metrics["goodput_per_device"]} for c in reranked[:k]],
    }
    (out / "validation.json").write_text(json.dumps(report, indent=1, default=float))
    plot(results, out / "validation.png")
    return report


def _accuracy_runs(runs, results):
    """The first run of each candidate (validate_candidate lists its accuracy run first)."""
    out, i = [], 0
    for res in results:
        out.append(runs[i])
        i += res["n_runs"]
    return out


def plot(results: list[dict], path: Path) -> None:
    """Predicted against measured, one panel per metric, one point per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.8))
    for ax, key in zip(axes, METRICS, strict=True):
        m = [r["measured"][key] for r in results]
        p = [r["predicted"][key] for r in results]
        ax.scatter(m, p, label="profile")
        if "refit_predicted" in results[0]:
            ax.scatter(m, [r["refit_predicted"][key] for r in results], marker="x", label="refitted")
        lo, hi = min(m + p) * 0.8, max(m + p) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=1)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2, label="±10%")
        ax.set_title(key)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
