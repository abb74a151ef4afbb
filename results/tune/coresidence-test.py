"""Hypothesis test (issue 15, pass 10): a probe's served step cycles alone vs beside the other probe copies.

Run: PYTHONPATH=$PWD /work/wt/timed .venv/bin/python results/tune/coresidence-test.py alone-p0 alone-p1 all7
(log: results/tune/coresidence-test.log; steps: /tmp/t15h/steps-*.json)."""
import engines  # noqa
import json, sys, time
from pathlib import Path
import numpy as np
from engines.config import EngineConfig, resolved_dtype
from tuner.measure_engine import PROBE_POSITIONS
from tuner.measure_served import SERVED_PROBES, serve_probes, step_cycles
from tuner.probe_model import gpt2_shape, write_random_checkpoint

tmp = Path("/tmp/t15h/ck"); tmp.mkdir(exist_ok=True)
dtype = resolved_dtype(EngineConfig(dtype="auto"))
paths = []
for i, (l, h, e, v) in enumerate(SERVED_PROBES):
    p = tmp / f"probe-{l}x{e}"
    if not (p / "config.json").exists():
        write_random_checkpoint(p, gpt2_shape(l, h, e, v, PROBE_POSITIONS))
    paths.append(p)
conds = {
    "alone-p0": {"p0-1x1": (paths[0], 1, 1, 2)},
    "alone-p1": {"p1-1x1": (paths[1], 1, 1, 2)},
    "all7": {"p0-1x1": (paths[0], 1, 1, 2), "p1-1x1": (paths[1], 1, 1, 2), "p2-1x1": (paths[2], 1, 1, 2),
             "p0-1x2": (paths[0], 1, 2, 1), "p1-1x2": (paths[1], 1, 2, 1),
             "p0-2x1": (paths[0], 2, 1, 1), "p1-2x1": (paths[1], 2, 1, 1)},
}
which = sys.argv[1:] or list(conds)
res = {}
for c in which:
    t0 = time.time()
    wd = Path(f"/tmp/t15h/{c}"); wd.mkdir(exist_ok=True)
    copies = conds[c]

    out = serve_probes(copies, wd, dtype, progress=lambda s: print(s, flush=True))
    res[c] = {n: out[n]["steps"] for n in out}
    for n in out:
        cyc = step_cycles(out[n]["steps"])
        dec1 = [dt + g for w, dt, g in cyc if w.prefill_attn_pairs == 0 and w.seqs == 1]
        dec = [dt + g for w, dt, g in cyc if w.prefill_attn_pairs == 0]
        allc = [dt + g for w, dt, g in cyc]
        print(f"{c} {n}: cycles {len(allc)} mean {np.mean(allc)*1e3:.2f} ms; decode b1 n={len(dec1)} "
              f"median {np.median(dec1)*1e3:.2f} mean {np.mean(dec1)*1e3:.2f}; decode all mean {np.mean(dec)*1e3:.2f}",
              flush=True)
    print(f"{c} took {time.time()-t0:.0f} s", flush=True)
Path(f"/tmp/t15h/steps-{'-'.join(which)}.json").write_text(json.dumps(res))
