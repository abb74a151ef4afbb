"""Megatron training on this CPU: recomputation overhead and TP=2 + SP against TP=1.

    .venv/bin/python benchmarks/bench_megatron.py --part recompute
    .venv/bin/python benchmarks/bench_megatron.py --part tp

recompute: one rank, 1 thread (wall and CPU time; CPU time is the work, robust to neighbours), a GPT-2 block shape where s << h (s=128, h=1024, a=16, 4 layers,
           b=4, fp32, dropout off): step time (forward + backward + AdamW) of recompute none,
           selective and full, interleaved rounds, best of N (the least disturbed by neighbours);
           the ratio against none is the figure.
tp:        the same global batch on TP=1 (1 rank, 2 threads) and TP=2 + SP (2 gloo ranks, 1 thread
           each) on this 2-core machine: best step time, saved-activation bytes per rank (hook),
           and each rank's peak RSS.
Shape and layouts are set below; the CPU model and load average are printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engines.core.config import ModelConfig

CFG = ModelConfig("gpt2", vocab_size=1024, n_layer=4, n_head=16, n_embd=1024, max_position_embeddings=128,
                  activation="gelu")
S, B, MICRO = 128, 4, 1


def _stage(spec, world: int, tp: int, rank: int):
    from training.parallel.groups import Layout, build_groups
    from training.parallel.setup import build_stage

    return build_stage(CFG, 0, build_groups(Layout.for_world(world, tp, 1), rank), spec, torch.device("cpu"))


def _step(stage, opt, batches, shape) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one training step."""
    from training.parallel.grads import clip_grads, sync_grads
    from training.parallel.schedule import run_step

    t, c = time.perf_counter(), time.process_time()
    run_step(stage, batches, "1f1b", shape, lambda: torch.autocast("cpu", enabled=False))
    sync_grads(stage)
    clip_grads(stage, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t, time.process_time() - c


def _batches(micro: int, b: int):
    ids = torch.randint(0, CFG.vocab_size, (micro, b, S + 1), generator=torch.Generator().manual_seed(0))
    return [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(micro)]


def recompute_part(rounds: int) -> None:
    """One thread, so that the process's CPU time is the step's work, whatever the neighbours do."""
    from training.optim import build_optimizer
    from training.parallel.model import ParallelSpec
    from training.recipe import OptimSpec

    torch.set_num_threads(1)
    runs = {}
    for rc in ("none", "selective", "full"):
        stage = _stage(ParallelSpec(recompute=rc), 1, 1, 0)
        runs[rc] = (stage, build_optimizer(stage, OptimSpec()))
    batches = _batches(MICRO, B)
    times = {rc: [] for rc in runs}
    for r in range(rounds + 1):
        for rc, (stage, opt) in runs.items():
            wall, cpu = _step(stage, opt, batches, (S, B, CFG.n_embd))
            if r:
                times[rc].append((wall, cpu))
    base_w, base_c = (min(t[i] for t in times["none"]) for i in (0, 1))
    print(f"recompute, s={S} h={CFG.n_embd} a={CFG.n_head} L={CFG.n_layer} b={B}, fp32, 1 thread, "
          f"best of {rounds} interleaved rounds")
    for rc, ts in times.items():
        w, c = min(t[0] for t in ts), min(t[1] for t in ts)
        print(f"  {rc:<10} wall {w * 1000:8.1f} ms (x{w / base_w:.3f})   CPU {c * 1000:8.1f} ms (x{c / base_c:.3f})")
    share = 4 * S / (24 * CFG.n_embd + 4 * S)
    print(f"  expectation: full ~ +33% (one more forward of 3 units of work; paper measured 36-39%), selective "
          f"~ the core-attention share of the forward: 4 s^2 h / (24 s h^2 + 4 s^2 h) = {share:.1%} of a forward "
          f"-> ~{share / 3:.1%} of a step (paper: 2-4% at its shapes)")


def _tp_worker(out: str, steps: int) -> None:
    from training.optim import build_optimizer
    from training.parallel.memory import measure_saved_bytes
    from training.parallel.model import ParallelSpec
    from training.recipe import OptimSpec

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = ParallelSpec(sequence_parallel=world > 1)
    stage = _stage(spec, world, world, rank)
    opt = build_optimizer(stage, OptimSpec())
    batches = _batches(MICRO, B)
    shape = (S // world, B, CFG.n_embd)
    times = []
    for i in range(steps + 1):
        dt = torch.tensor([_step(stage, opt, batches, shape)[0]])
        if world > 1:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i:
            times.append(dt.item())
    act = measure_saved_bytes(stage, *batches[0])
    acts = sum(v for k, v in act.per_layer.items())
    stats = torch.tensor([acts, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
                          sum(p.numel() * 4 for p in stage.parameters())], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": min(times), "act": stats[0].item(),
                                         "rss": stats[1].item(), "params": stats[2].item()}))
    if world > 1:
        dist.destroy_process_group()


def tp_part(steps: int) -> None:
    from training.distributed import spawn_local

    res = {}
    for label, world, threads in (("TP=1, 2 threads", 1, 2), ("TP=1, 1 thread", 1, 1), ("TP=2 + SP", 2, 1)):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "r.json")
            spawn_local(_tp_worker, world, (out, steps), threads_per_rank=threads)
            res[label] = json.loads(Path(out).read_text())
    print(f"TP=1 (1 rank) vs TP=2 + SP (2 gloo ranks x 1 thread), s={S} h={CFG.n_embd} "
          f"L={CFG.n_layer} b={B}, fp32, best of {steps} steps")
    for label, r in res.items():
        print(f"  {label:<16} step {r['step_s'] * 1000:8.1f} ms  "
              f"activations/rank {r['act'] / 2**20:7.1f} MiB  params/rank {r['params'] / 2**20:6.1f} MiB  "
              f"peak RSS/rank {r['rss'] / 2**20:7.1f} MiB")
    tp2 = res["TP=2 + SP"]
    for label in ("TP=1, 2 threads", "TP=1, 1 thread"):
        one = res[label]
        print(f"  TP2+SP / {label}: step time x{tp2['step_s'] / one['step_s']:.2f}, activations/rank "
              f"x{tp2['act'] / one['act']:.2f}, params/rank x{tp2['params'] / one['params']:.2f}, "
              f"peak RSS/rank x{tp2['rss'] / one['rss']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["recompute", "tp"], required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    recompute_part(args.rounds) if args.part == "recompute" else tp_part(args.rounds)


if __name__ == "__main__":
    main()
