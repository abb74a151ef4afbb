"""bf16 against fp32 on this machine: what `precision: auto` and the engine's `dtype="auto"` see.

    .venv/bin/python benchmarks/bench_precision.py [--config recipes/default.yaml] [--budget 60]

Measured in one run, back to back, with the probe harness the trainer and the engine use
(engines/core/hardware.py time_precisions), but with a budget long enough to time even an emulated
bf16 on full batches:
  train    forward + backward of the recipe's model and loss on (rows, seq_len) token batches
           (rows: the trainer's probe slice of the micro-batch), tokens/s in bf16 autocast and fp32
  forward  forward of the recipe model's MLP matmul pair on 256 tokens (the engine's probe)
and prints the CPU model and its bf16 features, the load average, the ratio bf16 / fp32, the
choice each `auto` makes, and the steps per second of the recipe at the fp32 and bf16 rates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.core.hardware import choose_precision, detect, engine_dtype, forward_probe, time_precisions
from training.model_setup import build_model
from training.precision import probe_shape, training_probe
from training.recipe import load_recipe, recipe_from_dict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/default.yaml")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for each probe (both precisions)")
    args = ap.parse_args()
    try:
        recipe = load_recipe(args.config)
    except ValueError:  # no prepared data folder: the shapes are all that matter here
        import yaml

        d = yaml.safe_load(Path(args.config).read_text())
        d["model"]["vocab_size"] = 8192
        recipe = recipe_from_dict(d)
    hw = detect("cpu")
    print(f"CPU: {hw.name}; bf16 hardware: {hw.bf16} ({hw.feature}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = build_model(recipe.model, recipe.train.seed, torch.device("cpu"))
    rows, seq_len = probe_shape(recipe)
    train = time_precisions(training_probe(model, recipe.model.vocab_size, torch.device("cpu")), rows, seq_len,
                            budget_s=args.budget)
    cfg = recipe.model
    fwd = time_precisions(forward_probe(cfg.n_embd, cfg.ffn_dim), 1, 256, budget_s=args.budget)
    per_step = recipe.tokens_per_step()
    print(f"train   {rows} x {seq_len} fwd+bwd   {train.describe()}")
    print(f"forward 256 x {cfg.n_embd}->{cfg.ffn_dim}->{cfg.n_embd}   {fwd.describe()}")
    print(f"training choice (precision: auto): {choose_precision('auto', hw, train).precision}; "
          f"engine choice (dtype=auto): {engine_dtype('cpu', rates=fwd).precision}")
    print(f"recipe steps/s ({per_step:,} tokens per step): fp32 {train.fp32 / per_step:.3f}, "
          f"bf16 {train.bf16 / per_step:.3f}")
    print(json.dumps({"cpu": hw.name, "bf16_hardware": hw.bf16, "train_bf16_tokens_per_s": round(train.bf16, 1),
                      "train_fp32_tokens_per_s": round(train.fp32, 1), "train_ratio": round(train.ratio, 4),
                      "forward_bf16_tokens_per_s": round(fwd.bf16, 1), "forward_fp32_tokens_per_s": round(fwd.fp32, 1),
                      "forward_ratio": round(fwd.ratio, 4)}))


if __name__ == "__main__":
    main()
