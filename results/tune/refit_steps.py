"""Refit a profile's layouts from its .steps.json (the probes' served steps), as `tune profile` does
(tuner/measure.py _served), without serving: for model changes tested offline (issue 15, passes 15-17).

Run (light, no lock needed): PYTHONPATH=$PWD .venv/bin/python results/tune/refit_steps.py PROFILE STEPS OUT
    [--fix-dram] [--h1] [--mean] [--prefill-1x1 | --prefill-0]
--mean: fit the mean served step, as `tune profile` did until pass 18 (now the typical one);
--fix-dram: multi-shard layouts take the one-shard layout's weight-streaming rate (the code since
63339ca); --h1: and its vocabulary and head costs unscaled by threads (likewise); --prefill-1x1 /
--prefill-0: multi-shard layouts take the one-shard layout's prefill_step_ms / none (default: each
layout fits its own, as `tune profile` does since w15-tuner6).
"""
import json
import sys

from tuner.cost import CostModel
from tuner.measure_engine import fit_layout
from tuner.measure_served import step_cycles
from tuner.probe_model import gpt2_shape
from tuner.profiles import load_profile

prof = load_profile(sys.argv[1])
with open(sys.argv[2]) as f:
    d = json.load(f)
out = sys.argv[3]
fix_dram = "--fix-dram" in sys.argv
PREFILL = "1x1" if "--prefill-1x1" in sys.argv else "0" if "--prefill-0" in sys.argv else None
base = prof.replace(layouts={})
layouts = {}
for key in ("1x1", "1x2", "2x1"):
    tp, pp = (int(v) for v in key.split("x"))
    rows = []
    for v in d.values():
        if v["layout"] != key: continue
        L, H, E, V = v["probe"]; cost = CostModel(gpt2_shape(L, H, E, V, 1024), base, tp=tp, pp=pp)
        rows += [(w, dt + g, cost) for w, dt, g in step_cycles(v["steps"])]
    one = layouts.get("1x1")
    f = 1.0 if "--h1" in sys.argv else base.threads(1) / base.threads(tp * pp)
    vocab = True if key == "1x1" else one["vocab_seq_ns"] * f
    head = True if key == "1x1" else one["head_ns"] * f
    kw = {}
    if fix_dram and key != "1x1":
        kw["dram"] = 1 / (one["dram_weight_gb_s"] * 1e9) if one["dram_weight_gb_s"] else 0.0
    if key != "1x1" and PREFILL is not None:  # --prefill-1x1 / --prefill-0: the multi-shard layouts' prefill step
        kw["prefill"] = one.get("prefill_step_ms", 0.0) if PREFILL == "1x1" else 0.0
    fit = fit_layout(rows, base.threads(tp * pp), vocab=vocab, mean="--mean" in sys.argv, head=head, **kw)
    old = prof.layouts[key]
    fit = {k: round(float(v), 4) if not isinstance(v, int) else v for k, v in fit.items()}
    for k in ("request_overhead_per_seq_ms", "served_gap_ms", "served_ttft_log_error", "served_overhead_per_seq_ms"):
        if k in old: fit[k] = old[k]
    layouts[key] = fit
    print(key, "median err", round(fit["probe_median_error_pct"], 1), "ratio", round(fit["probe_mean_ratio"], 3), "dram", fit["dram_weight_gb_s"])
prof.replace(layouts=layouts).save(out)
