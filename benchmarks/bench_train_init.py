"""Fine-tuning a pretrained model on the Megatron layouts: loss per step against one process.

    python benchmarks/bench_train_init.py --init MODEL_DIR --data DATA_DIR [--tp 3] [--pp 2] [--steps 5]

Runs the real trainer (training.trainer.train) from `--init` for `--steps` steps in fp32 on one
process, on TP=tp with sequence parallelism and selective recompute, and on PP=pp (gloo ranks on
this machine), and prints each step's loss and the largest difference from one process (issue 39
target: within 1e-4). DATA_DIR: `shardserve data --tokenizer MODEL_DIR --out DATA_DIR`. SmolLM2-135M
has 9 query / 3 key-value heads, so its TP size is 3 (2 does not divide the heads). Raw output goes
to runs/bench_train_init/.

    python benchmarks/bench_train_init.py --finetune --init MODEL_DIR --data DATA_DIR \
        [--recipe recipes/smollm2-shakespeare.yaml]

The ten-minute fine-tune point instead: the base's loss over the whole validation split, then
`shardserve train --config RECIPE --init MODEL_DIR` as a user runs it (the recipe's time budget, which
includes the trainer's final evaluation over the same whole split), and both perplexities (issue 39
target: the fine-tuned one >= 20 % below the base's).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def recipe(init: str, data: str, run: Path, steps: int, seq_len: int, **train) -> dict:
    return {"init": init, "data": {"dir": data, "seq_len": seq_len},
            "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "weight_decay": 0.0},
            "train": {"max_steps": steps, "batch_size": 4, "micro_batch_size": 2, "eval_every": 0,
                      "eval_windows": 1, "precision": "fp32", **train},
            "out": {"dir": str(run), "export_dir": ""}}


def _worker(rank: int, world: int, port: int, d: dict) -> None:
    from training.recipe import recipe_from_dict
    from training.trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train(recipe_from_dict(d), progress=False, log=lambda *a: None)
    dist.destroy_process_group()


def losses(run: Path) -> list[float]:
    from training.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def base_val_loss(recipe_path: str, init: str, data: str) -> tuple[float, int, float]:
    """(mean next-token loss, windows, seconds) of `init` over data's whole val split, fp32, seq_len
    and micro-batch of the recipe: the windows and loss the trainer's final evaluation uses."""
    import time

    from training.data import TokenData, val_starts
    from training.distributed import DistContext
    from training.model_setup import build_model
    from training.recipe import load_recipe
    from training.trainer import evaluate

    r = load_recipe(recipe_path, [f"data.dir={data}"], init)
    d = TokenData(data)
    starts = val_starts(d.meta["val_tokens"], r.data.seq_len, d.meta["val_tokens"])
    model = build_model(r.model, 0, torch.device("cpu"), init)
    t = time.perf_counter()
    loss = evaluate(model, d, starts, r, DistContext(), "fp32")
    return loss, len(starts), time.perf_counter() - t


def finetune(a) -> None:
    import math
    import subprocess
    import sys
    import time

    from training.metrics import read_metrics

    out = Path(a.out) / "finetune"
    out.mkdir(parents=True, exist_ok=True)
    base, windows, eval_s = base_val_loss(a.recipe, a.init, a.data)
    print(f"base: val loss {base:.4f} (ppl {math.exp(base):.2f}) over {windows} windows, {eval_s:.0f} s", flush=True)
    cmd = [sys.executable, "-m", "shardserve", "train", "--config", a.recipe, "--init", a.init, "--no-progress",
           "--set", f"data.dir={a.data}", "--set", f"out.dir={out / 'run'}", "--set", f"out.export_dir={out / 'model'}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"training failed ({proc.returncode}); see {out / 'train.log'}")
    rows = read_metrics(out / "run" / "metrics.jsonl")
    tuned = [r for r in rows if "val_loss" in r][-1]
    steps = max(r.get("step", 0) for r in rows)
    cut = 1 - math.exp(tuned["val_loss"]) / math.exp(base)
    res = {"base_val_loss": base, "tuned_val_loss": tuned["val_loss"], "steps": steps, "wall_s": wall,
           "trainer_elapsed_s": tuned.get("elapsed_s"), "val_windows": windows, "ppl_cut": cut}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    print(f"| model | val loss | val perplexity | |\n|---|---|---|---|\n"
          f"| base ({a.init}) | {base:.4f} | {math.exp(base):.2f} | |\n"
          f"| fine-tuned, {steps} steps, {wall:.0f} s wall ({a.recipe}) | {tuned['val_loss']:.4f} "
          f"| {math.exp(tuned['val_loss']):.2f} | {cut:.1%} below the base (target >= 20 %: "
          f"{'met' if cut >= 0.2 else 'MISSED'}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--finetune", action="store_true", help="the ten-minute fine-tune point instead (see above)")
    ap.add_argument("--recipe", default="recipes/smollm2-shakespeare.yaml")
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=192, help="a multiple of --tp (sequence parallelism)")
    ap.add_argument("--out", default="runs/bench_train_init")
    a = ap.parse_args()
    if a.finetune:
        finetune(a)
        return
    from training.distributed import free_port
    from training.recipe import recipe_from_dict
    from training.trainer import train

    out = Path(a.out)
    base = recipe(a.init, a.data, out / "single", a.steps, a.seq_len)
    train(recipe_from_dict(base), progress=False, log=lambda *x: None)
    results = {"single": losses(out / "single")}
    layouts = {f"tp{a.tp}+sp+selective": (a.tp, {"tensor_parallel_size": a.tp, "sequence_parallel": True,
                                                 "recompute": "selective"}),
               f"pp{a.pp}": (a.pp, {"pipeline_parallel_size": a.pp})}
    for name, (world, extra) in layouts.items():
        d = recipe(a.init, a.data, out / name, a.steps, a.seq_len, **extra)
        mp.start_processes(_worker, args=(world, free_port(), d), nprocs=world, start_method="spawn")
        results[name] = losses(out / name)
    print(f"| layout | loss per step (fp32, {a.steps} steps) | max abs diff vs one process |")
    print("|---|---|---|")
    for name, ls in results.items():
        diff = max(abs(x - y) for x, y in zip(ls, results["single"]))
        print(f"| {name} | {', '.join(f'{x:.6f}' for x in ls)} | {diff:.2e} |")
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
