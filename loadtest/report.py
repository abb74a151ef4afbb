"""Outputs: per-request JSONL, summary JSON and CSV, PNG plots, and the text printed to the console.

Files written to a result directory by `write_run`:
  requests.jsonl   one row per request (warm-up included, flagged), times in ms
  summary.json     config, summary, start time, early-stop reason
  summary.csv      the summary as one flat row
  latency_cdf.png  CDFs of TTFT, ITL and E2EL
and by `write_sweep`: sweep.json, sweep.csv (one row per step), sweep.png (throughput and latency
against the offered rate) and a `step_NN_rate_R/` directory per step with that run's files.
Files of the same name are overwritten. A sweep written where an earlier, longer one was also
removes that one's leftover `step_NN_rate_R/` directories, so every step directory belongs to the
sweep.json beside it; a directory holding anything this module did not write is left alone.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np

from loadtest.config import LoadTestConfig
from loadtest.metrics import Summary, json_safe
from loadtest.runner import Report
from loadtest.slo_sweep import SweepReport, SweepStep


def config_to_json(config: LoadTestConfig) -> dict:
    out = {}
    for k, v in asdict(config).items():
        if k == "api_key" and v:
            v = "***"  # never write a credential to disk
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, float) and math.isinf(v):
            v = "inf"
        out[k] = v
    return json_safe(out)


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def write_run(report: Report, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write one run's files into out_dir (created if needed); returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "requests.jsonl", out_dir / "summary.json", out_dir / "summary.csv"]
    with open(paths[0], "w") as f:
        f.writelines(json.dumps(rec.to_json()) + "\n" for rec in report.records)
    doc = {
        "started_at": report.started_at,
        "stop_reason": report.stop_reason,
        "interrupted": report.interrupted,
        "config": config_to_json(report.config),
        "summary": report.summary.to_json(),
    }
    paths[1].write_text(json.dumps(doc, indent=2) + "\n")
    _write_csv(paths[2], [report.summary.flat()])
    if plots:
        paths.append(plot_latency_cdfs(report, out_dir / "latency_cdf.png"))
    return paths


RUN_FILES = ("requests.jsonl", "summary.json", "summary.csv", "latency_cdf.png")  # write_run's
_STEP_DIR = re.compile(r"step_\d{2,}_rate_.+")


def _remove_stale_steps(out_dir: Path, keep: set[str]) -> None:
    """Delete step directories of an earlier sweep into out_dir: only those named as write_sweep
    names them and holding nothing but write_run's files (a user's own files are never lost)."""
    for d in out_dir.iterdir():
        if d.name in keep or not _STEP_DIR.fullmatch(d.name) or not d.is_dir() or d.is_symlink():
            continue
        files = list(d.iterdir())
        if all(f.name in RUN_FILES and f.is_file() and not f.is_symlink() for f in files):
            for f in files:
                f.unlink()
            d.rmdir()


def write_sweep(result: SweepReport, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write a sweep's table, plot and each step's run files; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in result.steps:
        # the step's verdict (which counts an early stop as a failure) wins over the summary's keys
        row = {"rate": s.rate, "phase": s.phase, "meets_slo": s.meets_slo, "stop_reason": s.stop_reason}
        rows.append({**row, **{k: v for k, v in s.summary.flat().items() if k not in row}})
    paths = [out_dir / "sweep.json", out_dir / "sweep.csv"]
    doc = {
        "best_rate": result.best_rate,
        "interrupted": result.interrupted,
        "config": config_to_json(result.config),
        "sweep_config": asdict(result.sweep_config),
        "steps": [
            {
                "rate": s.rate,
                "phase": s.phase,
                "meets_slo": s.meets_slo,
                "stop_reason": s.stop_reason,
                "summary": s.summary.to_json(),
            }
            for s in result.steps
        ],
    }
    paths[0].write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    _write_csv(paths[1], rows)
    step_dirs = [f"step_{i:02d}_rate_{step.rate:.4g}" for i, step in enumerate(result.steps)]
    _remove_stale_steps(out_dir, set(step_dirs))
    for name, rep in zip(step_dirs, result.reports):
        paths += write_run(rep, out_dir / name, plots=False)
    if plots and result.steps:
        paths.append(plot_sweep(result, out_dir / "sweep.png"))
    return paths


# --- plots (matplotlib's object API with the Agg canvas: no pyplot, no display, no global state) -


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def plot_latency_cdfs(report: Report, path: Path) -> Path:
    """TTFT, ITL and E2EL CDFs (ms) of the measured, successful requests."""
    ok = [r for r in report.records if not r.warmup and r.ok]
    series = {
        "TTFT": [r.ttft_s * 1e3 for r in ok],
        "ITL": [g * 1e3 for r in ok for g in r.itl_s],
        "E2EL": [r.e2el_s * 1e3 for r in ok],
    }
    fig = _figure(13, 3.8)
    for ax, (name, values) in zip(fig.subplots(1, 3), series.items()):
        ax.set_title(f"{name} CDF ({len(values)} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        x = np.sort(np.asarray(values))
        ax.plot(x, np.arange(1, x.size + 1) / x.size, drawstyle="steps-post")
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(x, q))
            ax.axvline(v, linestyle=style, color="gray", label=f"p{q} {v:.1f} ms")
        ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path)
    return path


def plot_sweep(result: SweepReport, path: Path) -> Path:
    """Left: achieved throughput vs offered rate. Right: p99 latencies vs achieved throughput."""
    steps = sorted(result.steps, key=lambda s: s.rate)
    rate = [s.rate for s in steps]
    thr = [s.summary.request_throughput for s in steps]
    fig = _figure(12, 4.5)
    left, right = fig.subplots(1, 2)
    left.plot(rate, thr, "o-", label="completed req/s")
    left.plot(rate, rate, "--", color="gray", label="offered = completed")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("throughput (req/s)")
    left.grid(alpha=0.3)
    left.legend()
    for metric, label in (("ttft_ms", "TTFT p99"), ("tpot_ms", "TPOT p99"), ("e2el_ms", "E2EL p99")):
        ys = [getattr(s.summary, metric).p99 for s in steps]
        right.plot(thr, ys, "o-", label=label)
        for s, x, y in zip(steps, thr, ys):
            if not s.meets_slo:
                right.plot([x], [y], "x", color="red", markersize=9)
    for slo in result.config.slos:
        right.axhline(slo.threshold_ms, linestyle=":", color="gray")
        right.annotate(
            f"SLO {slo.key} {slo.threshold_ms:g}",
            (0.01, slo.threshold_ms),
            xycoords=("axes fraction", "data"),
            fontsize=8,
        )
    right.set_yscale("log")
    right.set_xlabel("throughput (completed req/s); x = step failed its SLO")
    right.set_ylabel("latency (ms)")
    right.grid(alpha=0.3)
    right.legend()
    title = (
        f"best rate meeting the SLO: {result.best_rate:.3g} req/s"
        if result.best_rate
        else "no rate met the SLO"
    )
    fig.suptitle(title)
    fig.savefig(path)
    return path


# --- console text -------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_summary(s: Summary) -> str:
    """A vLLM-style result block."""
    lines = [
        "============ Load test result ============",
        f"Requests (measured / warm-up):  {s.requests} / {s.warmup_requests}",
        f"Successful / failed:            {s.completed} / {s.failed}",
        f"Duration (s):                   {_f(s.duration_s)}",
        f"Scheduled / achieved rate:      {_f(s.scheduled_rate)} / {_f(s.achieved_rate)} req/s",
        f"Send lag p50 / p99 (ms):        {_f(s.send_lag_ms.p50)} / {_f(s.send_lag_ms.p99)}",
        f"Request throughput (req/s):     {_f(s.request_throughput)}",
        f"Output token throughput (tok/s):{_f(s.output_throughput)}",
        f"Total input / output tokens:    {s.total_input_tokens} / {s.total_output_tokens}",
        f"Prompt lengths:                 {s.prompt_lengths}; output tokens from "
        + (", ".join(f"{k} ({v})" for k, v in s.output_tokens_source.items()) or "n/a"),
        f"Max requests in flight:         {s.max_in_flight}",
    ]
    header = f"{'':6}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}"
    lines += ["------------- Latency (ms) ---------------", header]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = getattr(s, name)
        lines.append(
            f"{name[:-3].upper():6}"
            + "".join(f"{_f(v):>10}" for v in (st.mean, st.p50, st.p90, st.p95, st.p99))
        )
    if s.errors:
        lines.append("Errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())))
    if s.slo_results:
        lines.append("------------------ SLO -------------------")
        for r in s.slo_results:
            lines.append(
                f"{r.key:16} {_f(r.observed_ms):>10} <= {r.threshold_ms:g}  {'ok' if r.ok else 'FAIL'}"
            )
        lines.append(f"Goodput (req/s):                {_f(s.goodput)} ({s.good_requests} good requests)")
    lines += [f"WARNING: {w}" for w in s.warnings]
    lines.append("==========================================")
    return "\n".join(lines)


SWEEP_HEADER = (
    f"{'rate':>9} {'phase':>7} {'achieved':>9} {'thru':>8} {'tok/s':>9} {'TTFT p99':>9} {'TPOT p99':>9} "
    f"{'E2EL p99':>9} {'goodput':>8} {'err':>5}  SLO"
)


def format_sweep_row(s: SweepStep) -> str:
    m = s.summary
    verdict = "ok" if s.meets_slo else ("FAIL (stopped early)" if s.stop_reason else "FAIL")
    return (
        f"{s.rate:9.3f} {s.phase:>7} {_f(m.achieved_rate):>9} {_f(m.request_throughput):>8} "
        f"{_f(m.output_throughput, 1):>9} {_f(m.ttft_ms.p99, 1):>9} {_f(m.tpot_ms.p99, 1):>9} "
        f"{_f(m.e2el_ms.p99, 1):>9} {_f(m.goodput):>8} {m.failed:>5}  {verdict}"
    )


def format_sweep_table(result: SweepReport) -> str:
    rows = [format_sweep_row(s) for s in sorted(result.steps, key=lambda s: s.rate)]
    best = (
        f"Highest rate meeting the SLO: {result.best_rate:.3f} req/s"
        if result.best_rate is not None
        else f"No rate >= {result.sweep_config.min_rate:g} req/s met the SLO"
    )
    return "\n".join([SWEEP_HEADER, *rows, best])
