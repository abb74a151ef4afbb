"""Fine-tuning a pretrained model on the Megatron layouts: loss per step against one process.

    python benchmarks/bench_train_init.py --init MODEL_DIR --data DATA_DIR [--tp 3] [--pp 2] [--steps 5]

Runs the real trainer (training.trainer.train) from `--init` for `--steps` steps in fp32 on one
process, on TP=tp with sequence parallelism and selective recompute, and on PP=pp (gloo ranks on
this machine), and prints each step's loss and the largest difference from one process (issue 39
target: within 1e-4). DATA_DIR: `shardserve data --tokenizer MODEL_DIR --out DATA_DIR`. SmolLM2-135M
has 9 query / 3 key-value heads, so its TP size is 3 (2 does not divide the heads). Raw output goes
to runs/bench_train_init/.

    nice -n 5 python benchmarks/bench_train_init.py --finetune --init MODEL_DIR --data DATA_DIR \
        [--recipe recipes/smollm2-shakespeare.yaml] [--val-windows N] [--set train.time_budget_s=600]

The ten-minute fine-tune point instead: `shardserve train --config RECIPE --init MODEL_DIR` as a user
runs it (its progress bar shown), with the trainer's final evaluation off (train.final_eval=false), so
the recipe's time budget is training alone; before and after it, outside the budget, the base and
the exported model are scored on the same fixed subset of the validation split: --val-windows windows
(default: the recipe's train.final_eval_windows) of the recipe's seq_len spread evenly over it
(training.data.val_starts; the SmolLM2 recipe's 96 x 256 = 24,576 of the
78,242 val tokens of SmolLM2's tokenizer: the base's loss there is 3.685, 0.010 nats from the whole
split's 3.675), in fp32, through the trainer's own evaluation. Prints both perplexities (issue 39 target:
the fine-tuned one >= 20 % below the base's), the CPU and the load average.
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


def val_loss(recipe, model_dir: str, starts, desc: str) -> tuple[float, float]:
    """(mean next-token loss, seconds) of the model in `model_dir` over the val windows `starts`, fp32,
    through the trainer's own evaluation (training.trainer.evaluate) a micro-batch at a time, with a bar."""
    import time

    from tqdm.auto import tqdm

    from training.data import TokenData
    from training.distributed import DistContext
    from training.model_setup import build_model
    from training.trainer import evaluate

    data = TokenData(recipe.data.dir)
    model = build_model(recipe.model, 0, torch.device("cpu"), model_dir)
    mb, total, t = recipe.train.micro_batch_size, 0.0, time.perf_counter()
    # every window has seq_len targets, so the mean of the chunks' means weighted by windows is the mean
    for i in tqdm(range(0, len(starts), mb), desc=desc, unit="batch", dynamic_ncols=True):
        chunk = starts[i:i + mb]
        total += evaluate(model, data, chunk, recipe, DistContext(), "fp32") * len(chunk)
    return total / len(starts), time.perf_counter() - t


def _stream(cmd: list[str], log_path: Path) -> int:
    """Run cmd with its output (the trainer's log and progress bar) shown here and kept in log_path."""
    import subprocess
    import sys

    with open(log_path, "wb") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as p:
        while chunk := p.stdout.read1(4096):
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return p.wait()


def finetune(a) -> None:
    import math
    import sys
    import time

    from benchmarks.common import cpu_line
    from training.data import val_starts
    from training.metrics import read_metrics
    from training.recipe import load_recipe

    out = Path(a.out) / "finetune"
    out.mkdir(parents=True, exist_ok=True)
    r = load_recipe(a.recipe, [f"data.dir={a.data}"], a.init)
    val_tokens = json.loads((Path(a.data) / "meta.json").read_text())["val_tokens"]
    windows = a.val_windows if a.val_windows is not None else r.train.final_eval_windows
    starts = val_starts(val_tokens, r.data.seq_len, windows or val_tokens)  # 0: the whole split
    n_tok = len(starts) * r.data.seq_len
    print(f"validation subset: {len(starts)} windows of {r.data.seq_len} tokens spread evenly over the val split "
          f"({n_tok:,} tokens), the same for both models", flush=True)
    base, base_s = val_loss(r, a.init, starts, "eval base")
    print(f"base: val loss {base:.4f} (ppl {math.exp(base):.2f}), {base_s:.0f} s", flush=True)
    # the trainer's final evaluation off: its time budget is then training alone (train.final_eval)
    cmd = [sys.executable, "-m", "shardserve", "train", "--config", a.recipe, "--init", a.init,
           "--set", f"data.dir={a.data}", "--set", "train.final_eval=false", "--set", "train.eval_every=0",
           "--set", f"out.dir={out / 'run'}", "--set", f"out.export_dir={out / 'model'}"]
    cmd += [x for kv in a.set for x in ("--set", kv)]
    load0 = os.getloadavg()
    t = time.perf_counter()
    rc = _stream(cmd, out / "train.log")
    wall, load1 = time.perf_counter() - t, os.getloadavg()
    if rc:
        raise SystemExit(f"training failed ({rc}); see {out / 'train.log'}")
    rows = [x for x in read_metrics(out / "run" / "metrics.jsonl") if "loss" in x]
    steps, train_s, tokens = rows[-1]["step"], rows[-1]["elapsed_s"], rows[-1]["tokens"]
    tuned, tuned_s = val_loss(r, str(out / "model"), starts, "eval fine-tuned")
    cut = 1 - math.exp(tuned) / math.exp(base)
    summary = json.loads((out / "run" / "training_summary.json").read_text()) \
        if (out / "run" / "training_summary.json").is_file() else {}
    res = {"base_val_loss": base, "tuned_val_loss": tuned, "ppl_cut": cut, "val_windows": len(starts),
           "val_tokens": n_tok, "steps": steps, "tokens": tokens, "train_s": train_s, "wall_s": wall,
           "eval_s": [base_s, tuned_s], "load_average": {"start": load0, "end": load1}, "cpu": cpu_line(),
           "threads": torch.get_num_threads(), "precision": summary.get("precision"), "cmd": cmd}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    print(f"\nCPU: {cpu_line()}; load average {load0[0]:.1f} at the start of training, "
          f"{load1[0]:.1f} at its end; recipe {a.recipe}" + (f" + {' '.join(a.set)}" if a.set else ""))
    print(f"validation: {len(starts)} windows x {r.data.seq_len} tokens ({n_tok:,} tokens, evenly spread over the "
          f"val split), fp32, outside the time budget\n")
    print(f"| model | val loss | val perplexity | |\n|---|---|---|---|\n"
          f"| base ({a.init}) | {base:.4f} | {math.exp(base):.2f} | |\n"
          f"| fine-tuned: {steps} steps, {tokens:,} tokens, {train_s:.0f} s of training | {tuned:.4f} "
          f"| {math.exp(tuned):.2f} | {cut:.1%} below the base (target >= 20 %: "
          f"{'met' if cut >= 0.2 else 'MISSED'}) |")
    print(f"\nraw output: {out}")


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
    ap.add_argument("--val-windows", type=int, default=None,
                    help="--finetune: validation windows (of the recipe's seq_len) spread evenly over the val split "
                         "[default: the recipe's train.final_eval_windows; 0: the whole split]")
    ap.add_argument("--set", action="append", default=[], help="--finetune: a recipe override for the trainer")
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
