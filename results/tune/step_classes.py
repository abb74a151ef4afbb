"""Served steps by class, measured against a profile's step cost (issue 15, w15-tuner6): where the
cost model is off, per kind of step, without serving anything (nothing timed: no lock needed).

    PYTHONPATH=$PWD .venv/bin/python results/tune/step_classes.py PROFILE accuracy-passN.json
    PYTHONPATH=$PWD .venv/bin/python results/tune/step_classes.py PROFILE this-machine-passN.steps.json [LAYOUT]

An accuracy.json gives each accuracy run's own last served steps (`steps.raw`: the replica's window
after the run, mostly its tail), a .steps.json the profile's probe steps. A class is D<b> (decode
only, b sequences; 5 = 5 or more) or P<b> (b sequences, one of them or more a prefill chunk);
each row: steps, median tokens, measured median cycle (step + gap after it), predicted median,
median of predicted / measured.
"""
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.bench_tuner import MODELS
from tuner.cost import CostModel, StepWork
from tuner.probe_model import gpt2_shape
from tuner.profiles import load_profile


def report(title: str, cost: CostModel, rows) -> None:
    """rows: (StepWork, measured cycle s)."""
    cls: dict[str, list] = {}
    for w, dt in rows:
        key = ("P" if w.prefill_attn_pairs else "D") + str(min(w.seqs or w.sampled, 5))
        cls.setdefault(key, []).append((dt * 1e3, cost.step_time(w) * 1e3, w.tokens))
    print(title)
    for key in sorted(cls):
        a = np.array(cls[key])
        print(f"  {key}: n={len(a):3d} tokens ~{np.median(a[:, 2]):4.0f}  measured {np.median(a[:, 0]):7.2f} ms  "
              f"predicted {np.median(a[:, 1]):7.2f} ms  ratio {np.median(a[:, 1] / a[:, 0]):.2f}")


def main() -> None:
    prof = load_profile(sys.argv[1])
    data = json.loads(Path(sys.argv[2]).read_text())
    only = sys.argv[3] if len(sys.argv) > 3 else None
    if "rows" in data:  # accuracy.json
        for r in data["rows"]:
            cost = CostModel(MODELS[r["model"]], prof, tp=r["tp"], pp=r["pp"])
            rows = [(StepWork(tokens=t, sampled=s, prefill_attn_pairs=p, decode_context=c, seqs=q), dt + gap)
                    for t, s, p, c, q, dt, gap in r.get("steps", {}).get("raw", [])]
            report(f"{r['model']} TP{r['tp']} PP{r['pp']} at {r['rate_req_s']:.2f} req/s", cost, rows)
        return
    from tuner.measure_served import step_cycles

    for name, v in data.items():  # .steps.json
        if only and v["layout"] != only:
            continue
        tp, pp = (int(x) for x in v["layout"].split("x"))
        n_layer, n_head, n_embd, vocab = v["probe"]
        cost = CostModel(gpt2_shape(n_layer, n_head, n_embd, vocab, 1024), prof, tp=tp, pp=pp)
        report(f"{name} {v['probe']}", cost, [(w, dt + gap) for w, dt, gap in step_cycles(v["steps"])])


if __name__ == "__main__":
    main()
