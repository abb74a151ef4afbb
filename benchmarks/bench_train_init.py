"""Fine-tuning a pretrained model on the Megatron layouts: loss per step against one process.

    python benchmarks/bench_train_init.py --init MODEL_DIR --data DATA_DIR [--tp 3] [--pp 2] [--steps 5]

Runs the real trainer (training.trainer.train) from `--init` for `--steps` steps in fp32 on one
process, on TP=tp with sequence parallelism and selective recompute, and on PP=pp (gloo ranks on
this machine), and prints each step's loss and the largest difference from one process (issue 39
target: within 1e-4). DATA_DIR: `shardserve data --tokenizer MODEL_DIR --out DATA_DIR`. SmolLM2-135M
has 9 query / 3 key-value heads, so its TP size is 3 (2 does not divide the heads). Raw output goes
to runs/bench_train_init/.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=192, help="a multiple of --tp (sequence parallelism)")
    ap.add_argument("--out", default="runs/bench_train_init")
    a = ap.parse_args()
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
