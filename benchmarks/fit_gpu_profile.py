"""Fit a GPU profile to shardserve's own engine, from static batches measured on the GPU.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fit_gpu_profile.py results/gpu/h200-run4.json \
        --base h200 --fit gpt2-medium,llama-1b,llama-8b --out tuner/profiles/h200-shardserve.yaml

The built-in GPU profiles (tuner/profiles/{a100-80gb,h100-sxm,h200}.yaml) carry constants fitted on
FasterTransformer's published latencies: they predict that engine. This fits the same analytic model
(the two efficiency factors by grid; by least squares on the relative error the fixed costs per layer,
per step, per layer of a prefill step (our prefill runs eagerly, our decode replays CUDA graphs) and
per sequence and layer; tuner.published.fit) to the `tuner` section of a `benchmarks/bench_gpu.py` run: B
requests of 60 input and 20 output tokens arriving together on our engine (bf16, CUDA graphs), its
latency, TTFT and TPOT each a point. Fitted on the models named by --fit (bf16); every other row
(other models, FP8) is held out and printed beside.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from benchmarks.bench_gpu import SHAPES
from engines.config import ModelConfig
from tuner.cost import CostModel, static_batch
from tuner.profiles import load_profile
from tuner.published import fit

METRICS = ("latency_ms", "ttft_ms", "tpot_ms")
CONSTS = ("layer_overhead_us", "step_overhead_ms", "prefill_layer_overhead_us", "seq_layer_overhead_us")  # one GPU


@dataclass(frozen=True)
class Point:
    model: str
    weight_dtype: str
    batch: int
    metric: str
    latency_ms: float  # the measured value of `metric` (the name tuner.published.fit reads)
    fitted: bool


def config(name: str) -> ModelConfig:
    """The shape bench_gpu.py measured (its random checkpoints use these positions)."""
    return ModelConfig(**SHAPES[name], max_position_embeddings=2048 if "llama" in name else 1024)


def predict(profile, p: Point, input_len: int = 60, output_len: int = 20) -> float:
    cost = CostModel(config(p.model), profile, tp=1, pp=1, weight_dtype=p.weight_dtype)
    return static_batch(cost, p.batch, input_len, output_len)[p.metric]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a bench_gpu.py --out JSON with a `tuner` section")
    ap.add_argument("--base", default="h200", help="the built-in profile whose datasheet constants are kept")
    ap.add_argument("--fit", default="gpt2-medium,llama-1b,llama-8b", help="models whose bf16 rows are fitted")
    ap.add_argument("--out", type=Path, default=None, help="write the fitted profile here (YAML)")
    args = ap.parse_args()
    run = json.loads(args.results.read_text())
    fit_models = set(args.fit.split(","))
    points = [Point(r["model"], r["weight_dtype"], r["batch"], m, r["measured"][m],
                    r["model"] in fit_models and r["weight_dtype"] == "bfloat16")
              for r in run["tuner"]["rows"] for m in METRICS]
    base = load_profile(args.base)
    prof = fit(base, [p for p in points if p.fitted], predict_fn=predict, consts=CONSTS)
    name = f"{args.base}-shardserve"
    env = run.get("env", {})
    prof = prof.replace(name=name, fit_notes=(
        f"shardserve's engine (bf16, CUDA graphs) on {env.get('name', 'a GPU')} with torch {env.get('torch', '?')}: "
        f"fitted by benchmarks/fit_gpu_profile.py on {args.results.name}, static batches 60 in / 20 out, "
        f"latency, TTFT and TPOT of {', '.join(sorted(fit_models))} (bf16) at batch 1 / 8 / 64; links and "
        f"collective latency are {args.base}'s (one GPU measured)"))
    print(f"fitted: bw_efficiency {prof.bw_efficiency}, flops_efficiency {prof.flops_efficiency}, "
          + ", ".join(f"{c} {getattr(prof, c)}" for c in CONSTS))
    groups: dict[tuple, list[float]] = {}
    print(f"{'model':12s} {'dtype':5s} {'B':>3s} {'metric':10s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for p in points:
        pred = predict(prof, p)
        err = pred / p.latency_ms - 1
        groups.setdefault((p.fitted, p.metric), []).append(abs(err))
        print(f"{p.model:12s} {p.weight_dtype[:4]:5s} {p.batch:3d} {p.metric:10s} {p.latency_ms:9.2f} {pred:9.2f} "
              f"{100 * err:+6.1f}%  {'fitted' if p.fitted else 'held out'}")
    for (fitted, metric), errs in sorted(groups.items()):
        print(f"{'fitted' if fitted else 'held out'} {metric}: {sum(e <= 0.25 for e in errs)}/{len(errs)} within 25%, "
              f"{sum(e <= 0.10 for e in errs)}/{len(errs)} within 10%, max {100 * max(errs):.1f}%")
    if args.out:
        head = (f"# {name}: the {args.base} datasheet constants with efficiency factors and fixed costs fitted on\n"
                f"# shardserve's own engine measured on the GPU (benchmarks/fit_gpu_profile.py; BENCHMARKS.md).\n")
        keep = {"name", "kind", "memory_gib", "hbm_bandwidth_gb_s", "flops_tflops", "intra_node_bandwidth_gb_s",
                "inter_node_bandwidth_gb_s", "devices_per_node", "bw_efficiency", "flops_efficiency",
                "layer_overhead_us", "step_overhead_ms", "prefill_layer_overhead_us", "seq_layer_overhead_us", "collective_latency_us",
                "reserved_memory_gib", "fit_notes"}
        body = {k: v for k, v in prof.to_dict().items() if k in keep}
        args.out.write_text(head + yaml.safe_dump(body, sort_keys=False))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
