"""Training throughput and model-FLOPs utilisation (MFU) of a recipe, bf16 on CPU by default.

    .venv/bin/python benchmarks/bench_train.py [--config recipes/default.yaml] [--threads 2]

Measured in one run, on the same threads:
  peak     the best bf16 (or fp32) torch.matmul rate over square sizes 1024..4096
  train    full optimizer steps of the recipe (micro-batches, fused loss, backward, clip, AdamW)
           on random tokens (the rate does not depend on the text)
  MFU      model FLOPs per token x tokens/s / peak, with model FLOPs per token
           = 6 x (matmul parameters) + 6 x n_layer x seq_len x n_embd (causal attention: half of
           the 12 L T C the PaLM paper counts for full attention; that figure is printed too)
Matmul parameters are the weights of every nn.Linear (lm_head included, tied or not); embedding
lookups, norms and biases do no matmul work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model_setup import NextTokenLoss, build_model  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.recipe import grad_accum_steps, load_recipe  # noqa: E402


def matmul_peak(dtype: torch.dtype, seconds: float = 1.0) -> tuple[float, int]:
    """Best FLOP/s of a square matmul and the size that reached it."""
    best, best_n = 0.0, 0
    for n in (1024, 2048, 3072, 4096):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        reps = max(2, int(seconds * 1e12 / (2 * n**3) / 4))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            times.append((time.perf_counter() - t0) / reps)
        rate = 2 * n**3 / min(times)
        if rate > best:
            best, best_n = rate, n
    return best, best_n


def matmul_params(model: nn.Module) -> int:
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def load_recipe_data_dir(path: str) -> str:
    import yaml

    d = yaml.safe_load(Path(path).read_text()) or {}
    return (d.get("data") or {}).get("dir", "data/shakespeare")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/default.yaml")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="default: the recipe's")
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    # without a prepared data folder the vocabulary is the data step's default
    has_data = (Path(load_recipe_data_dir(args.config)) / "meta.json").is_file()
    recipe = load_recipe(args.config, [] if has_data else ["model.vocab_size=8192"])
    precision = args.precision or recipe.train.precision
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg, t = recipe.model, recipe.train
    seq_len, mb = recipe.data.seq_len, t.micro_batch_size
    accum = grad_accum_steps(t, 1)

    model = build_model(cfg, t.seed, torch.device("cpu"))
    loss_fn = NextTokenLoss(model, dtype)
    opt = build_optimizer(model, recipe.optim)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab_size, (mb, seq_len), generator=gen),
                torch.randint(0, cfg.vocab_size, (mb, seq_len), generator=gen)) for _ in range(accum)]

    def step() -> None:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(x, y)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    peak_before, peak_n = matmul_peak(dtype)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_after, _ = matmul_peak(dtype)
    peak = max(peak_before, peak_after)

    tokens = t.batch_size * seq_len
    n_mm = matmul_params(model)
    n_all = sum(p.numel() for p in model.parameters())
    attn_causal = 6 * cfg.n_layer * seq_len * cfg.n_embd
    flops_tok = 6 * n_mm + attn_causal
    flops_tok_palm = 6 * n_mm + 2 * attn_causal
    med, best = statistics.median(times), min(times)
    tps_med, tps_best = tokens / med, tokens / best
    result = {
        "config": args.config, "precision": precision, "threads": args.threads,
        "params": n_all, "matmul_params": n_mm, "tokens_per_step": tokens,
        "step_s_median": round(med, 4), "step_s_best": round(best, 4),
        "tokens_per_s_median": round(tps_med), "tokens_per_s_best": round(tps_best),
        "model_flops_per_token": flops_tok, "peak_flops": round(peak), "peak_size": peak_n,
        "mfu_median": round(flops_tok * tps_med / peak, 4), "mfu_best": round(flops_tok * tps_best / peak, 4),
        "mfu_median_palm_attention": round(flops_tok_palm * tps_med / peak, 4),
    }
    print(f"recipe      {args.config}: {cfg.model_type} {cfg.n_layer}L x {cfg.n_embd}, {n_all / 1e6:.2f}M parameters "
          f"({n_mm / 1e6:.2f}M in matmuls), {tokens:,} tokens/step ({accum} x {mb} x {seq_len}), {precision}")
    print(f"peak        {peak / 1e9:,.0f} GFLOP/s ({precision} matmul {peak_n}^3, {args.threads} threads; "
          f"before {peak_before / 1e9:,.0f}, after {peak_after / 1e9:,.0f})")
    print(f"train       {tps_med:,.0f} tokens/s median, {tps_best:,.0f} best over {args.steps} steps "
          f"({med * 1e3:.0f} / {best * 1e3:.0f} ms per step)")
    print(f"model FLOPs {flops_tok / 1e6:.1f} MFLOP/token -> {flops_tok * tps_med / 1e9:,.0f} GFLOP/s median")
    print(f"MFU         {result['mfu_median']:.1%} median, {result['mfu_best']:.1%} best "
          f"({result['mfu_median_palm_attention']:.1%} median counting attention as PaLM does)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
