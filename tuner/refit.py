"""Refit a profile's coefficients from measured requests (the closed loop of `tune search --validate`).

The cost model's step time is a sum of parts (CostModel.components), each scaled by one profile
coefficient, and the gateway adds request_overhead_ms to each request's TTFT. Given a simulated
schedule of the measured workload (same arrivals, same lengths), every request's TTFT and TPOT
are linear in those coefficients: TPOT is the mean of the steps between its first and last
token, TTFT the gateway overhead plus the steps (or the part of the step in flight) between its
arrival at the engine and its first token. A non-negative, ridge-regularised least squares on
relative errors (toward the current profile, so that a coefficient the data cannot see stays
where it was) gives new factors; the schedule is simulated again with them and the fit repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerConfig
from tuner.cost import COMPONENTS, CostModel
from tuner.profiles import LAYOUT_DECODE, HardwareProfile
from tuner.simulate import StepRecord, simulate

COEFFICIENTS = (*COMPONENTS, "request")
# where a profile holds 0 for an additive constant, the fit still needs a unit to scale
_UNITS = {"layer_overhead_us": 10.0, "seq_layer_overhead_us": 10.0, "seq_overhead_us": 10.0,
          "step_overhead_ms": 1.0, "request_overhead_ms": 1.0}
_FIELD = {"layer": "layer_overhead_us", "seq_layer": "seq_layer_overhead_us", "seq": "seq_overhead_us",
          "step": "step_overhead_ms", "request": "request_overhead_ms"}


@dataclass(frozen=True)
class Run:
    """One measured load-test run of one layout: the schedule it was offered and what each request saw."""

    model: ModelConfig
    tp: int
    pp: int
    weight_dtype: str
    sched: SchedulerConfig
    arrivals: np.ndarray  # s from the start, as scheduled
    input_lens: np.ndarray
    output_lens: np.ndarray
    ttft_s: np.ndarray  # measured, NaN for a failed request
    tpot_s: np.ndarray
    text_share: float = 1.0
    """Share of the served checkpoint's token ids with text (tuner.probe_model.text_token_share):
    how the client's TPOT is simulated (tuner.simulate.seen_last_times)."""


def _unit_profile(p: HardwareProfile) -> tuple[HardwareProfile, dict[str, float]]:
    """The profile with every additive constant at least its unit, and the factors that take
    the unit profile back to `p` (the ridge prior)."""
    changes = {f: getattr(p, f) or u for f, u in _UNITS.items()}
    prior = {c: 1.0 for c in COEFFICIENTS}
    for c, f in _FIELD.items():
        # a profile with per-layout constants uses those, scaled by the same factor (see apply):
        # factor 1 leaves them as measured, whatever the global (fallback) value
        if not (p.layouts and c != "request"):
            prior[c] = getattr(p, f) / changes[f]
    return p.replace(**changes), prior


def _sig(x: float) -> float:
    """x to six significant digits: a constant moved by a small factor stays nonzero (rounded to six
    decimals a rate of 0.03 TFLOP/s or a matmul_scale of 0.5 times a factor of 1e-6 became 0, which
    no profile accepts)."""
    return float(f"{float(x):.6g}")


def _scaled_layout(p: HardwareProfile, key: str, lay: dict, t: dict[str, float]) -> dict:
    """A layout's constants moved by the factors `t` (apply); its decode-step constants
    (profiles.LAYOUT_DECODE) likewise."""
    out = {**lay, **{f: _sig(lay[f] * t[c]) for c, f in _FIELD.items() if c != "request"},
           "attention_prefill_tflops": _sig(lay["attention_prefill_tflops"] / t["attention"]),
           "attention_kv_gb_s": _sig(lay["attention_kv_gb_s"] / t["attention"]),
           "vocab_seq_ns": _sig(lay.get("vocab_seq_ns", 0.0) * t["seq"]),
           "head_ns": _sig(lay.get("head_ns", 0.0) * t["seq"]),
           "prefill_step_ms": _sig(lay.get("prefill_step_ms", 0.0) * t["step"]),
           # weights read past the cache are part of the matmul time
           "dram_weight_gb_s": _sig(lay.get("dram_weight_gb_s", 0.0) / t["matmul"]),
           # a layout's matmul reads the one-thread table: where its shards run
           # several threads, it moves by matmul_mt, not by the shared efficiency
           "matmul_scale": _sig(lay["matmul_scale"] * (t["matmul_mt"] / t["matmul"]
                                 if p.threads(_shards(key)) > 1 else 1.0))}
    if "decode_batch_layer_us" in lay:  # a per-layer cost of decode batches (fit_on_engine)
        out["decode_batch_layer_us"] = _sig(lay["decode_batch_layer_us"] * t["layer"])
    if "served_step_ms" in lay:  # the served decode step's own ms (fit_on_engine): a per-step cost
        out["served_step_ms"] = _sig(lay["served_step_ms"] * t["step"])
    if isinstance(lay.get(LAYOUT_DECODE), dict):
        out[LAYOUT_DECODE] = _scaled_layout(p, key, lay[LAYOUT_DECODE], t)
    return out


def apply(p: HardwareProfile, theta: dict[str, float]) -> HardwareProfile:
    """The profile whose step-time parts are `theta` times those of `p` (p from _unit_profile)."""
    t = {c: max(float(theta.get(c, 1.0)), 1e-6) for c in COEFFICIENTS}
    changes = {f: getattr(p, f) * t[c] for c, f in _FIELD.items()}
    changes["flops_efficiency"] = min(p.flops_efficiency / t["matmul"], 4.0)
    changes["bw_efficiency"] = min(p.bw_efficiency / t["matmul"], 4.0)
    if p.matmul_tflops:  # multi-thread rate tables move by matmul_mt (relative to the shared efficiency)
        rel = t["matmul"] / t["matmul_mt"]
        changes["matmul_tflops"] = {th: ({d: {r: _sig(v * rel) for r, v in rows.items()}
                                          for d, rows in tab.items()}
                                         if int(th) > 1 else tab) for th, tab in p.matmul_tflops.items()}
    if p.layouts:  # per-layout constants move with the same factors as the global ones
        changes["layouts"] = {key: _scaled_layout(p, key, lay, t) for key, lay in p.layouts.items()}
    if p.attention_kv_gb_s:
        changes["attention_kv_gb_s"] = p.attention_kv_gb_s / t["attention"]
    if p.attention_prefill_tflops:
        changes["attention_prefill_tflops"] = p.attention_prefill_tflops / t["attention"]
    changes["collective_latency_us"] = p.collective_latency_us * t["comm"]
    changes["send_latency_us"] = (p.send_latency_us or p.collective_latency_us) * t["comm"]
    changes["intra_node_bandwidth_gb_s"] = p.intra_node_bandwidth_gb_s / t["comm"]
    changes["inter_node_bandwidth_gb_s"] = p.inter_node_bandwidth_gb_s / t["comm"]
    return p.replace(**{k: v if isinstance(v, dict) else _sig(float(v)) for k, v in changes.items()},
                     kind="measured")


def _shards(key: str) -> int:
    tp, pp = key.split("x")
    return int(tp) * int(pp)


def _rows(run: Run, cost: CostModel, unit: CostModel) -> tuple[list[np.ndarray], list[float]]:
    """Relative-error rows: the schedule is simulated with `cost`, the columns are the parts of
    `unit` (the unit profile), so that a row times the factors is the predicted TTFT or TPOT."""
    request_unit_s = unit.profile.request_overhead_ms * 1e-3
    steps: list[StepRecord] = []
    traces = simulate(cost.step_time, run.sched, run.arrivals, run.input_lens, run.output_lens,
                      request_overhead=cost.profile.request_overhead_ms * 1e-3, steps_out=steps,
                      text_share=run.text_share)
    ends = np.array([s.end for s in steps])
    starts = np.array([s.start for s in steps])
    parts: dict = {}  # by work: a schedule repeats its steps' work (tuner.cost.CostModel.step_time)
    for s in steps:
        if s.work not in parts:
            parts[s.work] = [unit.components(s.work)[c] for c in COMPONENTS]
    comp = np.array([parts[s.work] for s in steps])  # (steps, parts)
    rows, ys = [], []
    for i, tr in enumerate(traces):
        if len(tr.token_times) == 0:
            continue
        at = tr.arrival + cost.profile.request_overhead_ms * 1e-3
        first, last = tr.token_times[0], tr.token_times[-1]
        if np.isfinite(run.ttft_s[i]) and run.ttft_s[i] > 0:
            sel = (ends > at) & (ends <= first + 1e-12)
            frac = np.clip((ends[sel] - np.maximum(starts[sel], at)) / np.maximum(ends[sel] - starts[sel], 1e-12), 0, 1)
            row = np.append(frac @ comp[sel], request_unit_s)
            rows.append(row / run.ttft_s[i])
            ys.append(1.0)
        n = len(tr.token_times)
        if n > 1 and np.isfinite(run.tpot_s[i]) and run.tpot_s[i] > 0:
            sel = (ends > first + 1e-12) & (ends <= last + 1e-12)
            seen = (tr.last_seen - first) / max(last - first, 1e-12)  # the share of the span the client sees
            row = np.append(comp[sel].sum(axis=0) * seen / (n - 1), 0.0)
            rows.append(row / run.tpot_s[i])
            ys.append(1.0)
    return rows, ys


def refit(profile: HardwareProfile, runs: list[Run], free: tuple[str, ...] = COEFFICIENTS,
          ridge: float = 1e-4, iterations: int = 3, polish: int = 150) -> tuple[HardwareProfile, dict[str, float]]:
    """A profile refitted on `runs`; returns it and the factors applied to each coefficient
    (1 = unchanged; inf where the profile had none). Only the coefficients in `free` move;
    `polish` bounds the simulated evaluations of the final Nelder-Mead stage (0 skips it)."""
    from tuner.measure_engine import nnls as _nnls

    unknown = sorted(set(free) - set(COEFFICIENTS))
    if unknown:
        raise ValueError(f"free: unknown coefficient(s) {', '.join(unknown)}; allowed: {', '.join(COEFFICIENTS)}")
    if not runs:
        raise ValueError("runs: nothing measured to refit on")
    base, prior = _unit_profile(profile)
    theta = dict(prior)
    idx = [COEFFICIENTS.index(c) for c in free]
    for _ in range(iterations):
        cur = apply(base, theta)
        rows, ys = [], []
        for run in runs:
            cost = CostModel(run.model, cur, tp=run.tp, pp=run.pp, weight_dtype=run.weight_dtype)
            unit = CostModel(run.model, base, tp=run.tp, pp=run.pp, weight_dtype=run.weight_dtype)
            r, y = _rows(run, cost, unit)
            rows += r
            ys += y
        a_base, y = np.array(rows), np.array(ys)  # columns: the unit profile's parts (factor 1 each)
        th_now = np.array([theta[c] for c in COEFFICIENTS])
        fixed = [j for j in range(len(COEFFICIENTS)) if j not in idx]
        rhs = y - a_base[:, fixed] @ th_now[fixed] if fixed else y
        pri = np.array([prior[COEFFICIENTS[j]] for j in idx])  # 1 (the profile's value) or 0 (it had none)
        scale = np.maximum(np.abs(a_base[:, idx]).max(axis=0), 1e-12)  # columns to ~1: z = theta * scale
        pen = np.sqrt(ridge * len(y)) * np.eye(len(idx))  # ridge on theta - prior
        aa = np.vstack([a_base[:, idx] / scale, pen / scale])
        bb = np.concatenate([rhs, pen @ pri])
        sol = _nnls(aa, bb) / scale
        for j, v in zip(idx, sol, strict=True):
            theta[COEFFICIENTS[j]] = float(v)
    # the linear fit holds each schedule fixed; queueing makes TTFT non-linear in the step time,
    # so polish on the simulated runs themselves (Nelder-Mead in log factors, from the linear fit)
    if polish and idx:
        def loss(z: np.ndarray) -> float:
            th = {**theta, **{free[k]: float(np.exp(v)) for k, v in enumerate(z)}}
            return _loss(apply(base, th), runs) + ridge * sum((th[c] - prior[c]) ** 2 for c in free)

        start = np.log(np.maximum([theta[c] for c in free], 1e-3))
        # the linear fit or the profile as it was, whichever fits better, starts the simplex
        alt = np.log(np.maximum([prior[c] for c in free], 1e-3))
        z = _nelder_mead(loss, start if loss(start) <= loss(alt) else alt, max_evals=polish)
        theta.update({free[k]: float(np.exp(v)) for k, v in enumerate(z)})
    factors = {c: (theta[c] / prior[c] if prior[c] else (np.inf if theta[c] > 1e-3 else 1.0)) for c in COEFFICIENTS}
    return apply(base, theta), factors


def _loss(p: HardwareProfile, runs: list[Run]) -> float:
    """Mean squared log error of every request's simulated TTFT and TPOT against the measured."""
    err, n = 0.0, 0
    for run in runs:
        cost = CostModel(run.model, p, tp=run.tp, pp=run.pp, weight_dtype=run.weight_dtype)
        traces = simulate(cost.step_time, run.sched, run.arrivals, run.input_lens, run.output_lens,
                          request_overhead=p.request_overhead_ms * 1e-3, text_share=run.text_share)
        for tr, ttft, tpot in zip(traces, run.ttft_s, run.tpot_s, strict=True):
            if np.isfinite(ttft) and ttft > 0:
                err += np.log(tr.ttft / ttft) ** 2
                n += 1
            if len(tr.token_times) > 1 and np.isfinite(tpot) and tpot > 0:
                err += np.log(tr.tpot / tpot) ** 2
                n += 1
    return err / max(n, 1)


def _nelder_mead(f, x0: np.ndarray, max_evals: int = 200, step: float = 0.3) -> np.ndarray:
    """Minimise f from x0 (standard reflection / expansion / contraction / shrink)."""
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-7:
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        evals += 1
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
                evals += n
    return pts[int(np.argmin(vals))]
