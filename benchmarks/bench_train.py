"""Training throughput and model-FLOPs utilisation (MFU) of a recipe, bf16 on CPU by default.

    .venv/bin/python benchmarks/bench_train.py [--config recipes/default.yaml] [--ranks 2] [--steps 30]

Measured in one run:
  peak    the best bf16 torch.matmul rate of this machine: square sizes 1024..4096, one process
          using all cores (--peak-threads), taken before and after the training run (best kept)
  train   the real training loop (training.trainer.train) for --steps optimizer steps, launched
          as `shardserve train` launches it: --ranks data-parallel processes (gloo), each with
          cores / ranks threads (default: one rank, as `make model` trains); tokens/s is each
          step's global tokens over its wall time, from the run's metrics.jsonl (the first --skip
          steps are warmup and are not counted)
  probes  with one rank, a short matmul probe (2048^3 and 3072^3, best of 2 each) after every
          step, outside the step's timing: the machine is shared and its speed drifts by up to
          1.6x within a minute, so each step is also set against the peak measured next to it
  MFU     model FLOPs per token x tokens/s / peak, with model FLOPs per token
          = 6 x (matmul parameters) + 6 x n_layer x seq_len x n_embd (causal attention: half of the
          12 L T C that the PaLM paper counts for full attention; that variant is printed too).
          "global": median tokens/s over the best peak of the whole run (every sweep and probe);
          "paired": the median over steps of each step's rate over the best of the probes just
          before and after it
Matmul parameters are the weights of every nn.Linear (lm_head included, tied or not); embedding
lookups, norms and biases do no matmul work. Without the recipe's data folder, random tokens of
the recipe's vocabulary stand in (the rate does not depend on the text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.cli import _worker
from training.distributed import spawn_local
from training.metrics import read_metrics
from training.model_setup import build_model
from training.recipe import load_recipe, recipe_from_dict


def matmul_probe(dtype: torch.dtype, sizes: tuple[int, ...] = (2048, 3072), reps: int = 2) -> float:
    """A short peak probe on the current threads (~0.1 s): the best single n^3 matmul over the two
    sizes at which the full sweep usually peaks, in FLOP/s."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def matmul_peak(dtype: torch.dtype, threads: int, seconds: float = 0.5) -> tuple[float, int]:
    """Best FLOP/s of a square matmul on `threads` threads, and the size that reached it."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    best, best_n = 0.0, 0
    for n in (1024, 2048, 3072, 4096):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        reps = max(2, int(seconds * 1e12 / (2 * n**3)))
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            rate = 2 * n**3 * reps / (time.perf_counter() - t0)
            if rate > best:
                best, best_n = rate, n
    torch.set_num_threads(old)
    return best, best_n


def matmul_params(model: nn.Module) -> int:
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def random_data(folder: Path, vocab: int, n_train: int = 1 << 20, n_val: int = 1 << 14) -> None:
    """A data folder of random tokens with the layout `shardserve data` writes."""
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", n_train), ("val.bin", n_val)):
        rng.integers(1, vocab, n, dtype=np.uint16).tofile(folder / name)
    meta = {"format": "shardserve-tokens/1", "vocab_size": vocab, "dtype": "uint16", "eos_token_id": 0,
            "bos_token_id": 0, "train_tokens": n_train, "val_tokens": n_val, "sha256": {}}
    (folder / "meta.json").write_text(json.dumps(meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/default.yaml")
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel processes (1: in this process)")
    ap.add_argument("--threads-per-rank", type=int, default=0, help="0: cores / ranks")
    ap.add_argument("--peak-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps run")
    ap.add_argument("--skip", type=int, default=5, help="first steps not counted (warmup)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="default: the recipe's")
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args()

    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.ranks)
    base = load_recipe(args.config, [] if Path(_data_dir(args.config), "meta.json").is_file()
                       else ["model.vocab_size=8192"])
    precision = args.precision or base.train.precision
    if precision == "auto":  # the peak must be measured in the precision trained: fix it here, as auto would pick
        from engines.core.hardware import detect

        precision = "bf16" if detect("cpu").bf16 else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak_before, peak_n = matmul_peak(dtype, args.peak_threads)

    with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp:
        d = base.to_dict()
        if not (Path(d["data"]["dir"]) / "meta.json").is_file():
            random_data(Path(tmp), base.model.vocab_size)
            d["data"]["dir"] = tmp
        d["train"].update(max_steps=args.steps, time_budget_s=0.0, eval_every=0, eval_windows=1, ckpt_every=0,
                          log_every=1, precision=precision, num_threads=threads)
        d["optim"]["warmup_steps"] = min(d["optim"]["warmup_steps"], args.steps)
        if d["train"]["batch_size"] % (d["train"]["micro_batch_size"] * args.ranks):
            # the same global batch split over more ranks: each rank's share in one micro-batch
            d["train"]["micro_batch_size"] = d["train"]["batch_size"] // args.ranks
        d["out"] = {"dir": str(Path(tmp) / "run"), "export_dir": ""}
        recipe = recipe_from_dict(d)
        job = {"recipe": recipe.to_dict(), "resume": False, "progress": False}
        probes: list[float] = []
        if args.ranks == 1:
            from training.trainer import train

            torch.set_num_threads(threads)
            probes.append(matmul_probe(dtype))
            train(recipe, progress=False, on_step=lambda state, record: probes.append(matmul_probe(dtype)),
                  log=lambda *a, **k: None)
        else:
            spawn_local(_worker, args.ranks, (job,), threads_per_rank=threads)
        records = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "tokens_per_s" in r]
    peak_after, _ = matmul_peak(dtype, args.peak_threads)
    peak = max([peak_before, peak_after] + probes)

    cfg, seq_len = recipe.model, recipe.data.seq_len
    rates = [r["tokens_per_s"] for r in records[args.skip:]]
    # step i (1-based) ran between probes[i - 1] and probes[i]
    paired = [r["tokens_per_s"] / max(probes[r["step"] - 1], probes[r["step"]])
              for r in records[args.skip:]] if len(probes) > len(records) else []
    med, best = statistics.median(rates), max(rates)
    model = build_model(cfg, 0, torch.device("cpu"))
    n_mm, n_all = matmul_params(model), sum(p.numel() for p in model.parameters())
    attn = 6 * cfg.n_layer * seq_len * cfg.n_embd
    flops_tok = 6 * n_mm + attn
    result = {
        "config": args.config, "precision": precision, "ranks": args.ranks, "threads_per_rank": threads,
        "params": n_all, "matmul_params": n_mm, "tokens_per_step": recipe.tokens_per_step(),
        "steps_counted": len(rates), "tokens_per_s_median": round(med), "tokens_per_s_best": round(best),
        "model_flops_per_token": flops_tok, "peak_flops": round(peak), "peak_size": peak_n,
        "peak_threads": args.peak_threads,
        "mfu_median": round(flops_tok * med / peak, 4), "mfu_best": round(flops_tok * best / peak, 4),
        "mfu_median_palm_attention": round((flops_tok + attn) * med / peak, 4),
        "mfu_paired_median": round(flops_tok * statistics.median(paired), 4) if paired else None,
        "probe_flops_min": round(min(probes)) if probes else None,
        "probe_flops_max": round(max(probes)) if probes else None,
    }
    print(f"recipe      {args.config}: {cfg.model_type} {cfg.n_layer}L x {cfg.n_embd}, {n_all / 1e6:.2f}M parameters "
          f"({n_mm / 1e6:.2f}M in matmuls), {recipe.tokens_per_step():,} tokens/step, {precision}")
    print(f"launch      {args.ranks} rank(s) x {threads} thread(s)")
    print(f"peak        {peak / 1e9:,.0f} GFLOP/s ({precision} matmul {peak_n}^3 on {args.peak_threads} threads; "
          f"sweep before {peak_before / 1e9:,.0f}, after {peak_after / 1e9:,.0f}"
          + (f", best of {len(probes)} probes {max(probes) / 1e9:,.0f})" if probes else ")"))
    print(f"train       {med:,.0f} tokens/s median, {best:,.0f} best, over {len(rates)} steps")
    print(f"model FLOPs {flops_tok / 1e6:.1f} MFLOP/token -> {flops_tok * med / 1e9:,.0f} GFLOP/s median")
    print(f"MFU global  {result['mfu_median']:.1%} median, {result['mfu_best']:.1%} best "
          f"({result['mfu_median_palm_attention']:.1%} median counting attention as PaLM does)")
    if paired:
        print(f"paired      {result['mfu_paired_median']:.1%} median MFU, each step over the peak probed beside it "
              f"(probes {min(probes) / 1e9:,.0f}-{max(probes) / 1e9:,.0f} GFLOP/s)")
    if args.json:
        print(json.dumps(result))


def _data_dir(path: str) -> str:
    import yaml

    d = yaml.safe_load(Path(path).read_text()) or {}
    return (d.get("data") or {}).get("dir", "data/shakespeare")


if __name__ == "__main__":
    main()
