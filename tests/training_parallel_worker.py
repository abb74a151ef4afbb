"""Worker side of tests/test_training_parallel.py: one process of a gloo world that trains a tiny
GPT on several layouts in turn and saves, on rank 0, each step's loss and gathered gradients."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engines.core.config import ModelConfig
from training.optim import build_optimizer
from training.parallel.grads import clip_grads, sync_grads
from training.parallel.groups import Layout, build_groups
from training.parallel.model import ParallelSpec
from training.parallel.schedule import run_step
from training.parallel.setup import build_stage
from training.parallel.state import gather_model
from training.recipe import OptimSpec

OPTIM = OptimSpec(lr=1e-2, warmup_steps=0, grad_clip=0.5)
STEPS, SEQ, MB, M = 5, 8, 2, 2  # M micro-batches of MB sequences per DP rank per step


def batches(cfg: ModelConfig, step: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of a step as dp * M micro-batches (x, y), in DP-rank-major order."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab_size, (dp * M * MB, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    return [(x[i:i + MB], y[i:i + MB]) for i in range(0, len(x), MB)]


def run_layout(cfg: ModelConfig, tp: int, pp: int, spec: ParallelSpec, schedule: str, seed: int = 0):
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = build_groups(Layout.for_world(world, tp, pp), rank)
    dp = groups.layout.dp
    torch.manual_seed(seed * 7919 + groups.dp_rank)  # the default stream: shared by a TP group
    stage = build_stage(cfg, seed, groups, spec, torch.device("cpu"))
    opt = build_optimizer(stage, OPTIM)
    shape = (SEQ // tp if spec.sequence_parallel else SEQ, MB, cfg.n_embd)
    losses, grads = [], []
    for step in range(STEPS):
        mine = batches(cfg, step, dp)[groups.dp_rank * M:(groups.dp_rank + 1) * M]
        stats = run_step(stage, mine, schedule, shape, lambda: torch.autocast("cpu", enabled=False))
        sync_grads(stage)
        loss = torch.tensor([stats.loss_sum / M if stage.last and groups.tp_rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(loss.item() / dp)
        grads.append(gather_model(stage, grads=True))
        clip_grads(stage, OPTIM.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    """cases: (name, model config, tp, pp, ParallelSpec, schedule), run in order on every rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, cfg, tp, pp, spec, schedule in cases:
        results[name] = run_layout(cfg, tp, pp, spec, schedule)
    if any(name == "tp2" for name, *_ in cases):  # activation memory of each Table-2 variant at t = 2
        from training.parallel.memory import VARIANTS, formula_bytes, measure_saved_bytes

        cfg = ModelConfig("gpt2", vocab_size=64, n_layer=2, n_head=4, n_embd=64, max_position_embeddings=64)
        s, b = 64, 2
        for name, uses_tp, spec in VARIANTS:
            tp = 2 if uses_tp else 1
            stage = build_stage(cfg, 0, build_groups(Layout.for_world(world, tp, 1), rank), spec, torch.device("cpu"))
            x = torch.randint(0, 64, (b, s))
            measured = measure_saved_bytes(stage, x, x).mean
            results[f"memory_{name}"] = (measured, formula_bytes(name, s, b, 64, 4, tp))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def train_worker(rank: int, world: int, port: int, runs: list) -> None:
    """runs: (recipe dict, resume, stop after step or 0), trained in order with the real loop; a stop
    is a SIGTERM to rank 0 (the signal path a user takes), which every rank learns of in the next step."""
    import signal

    from training.recipe import recipe_from_dict
    from training.trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for d, resume, stop in runs:
        def on_step(state, record, stop=stop):
            if stop and state.step == stop and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        train(recipe_from_dict(d), resume=resume, progress=False, on_step=on_step, log=lambda *a: None)
    dist.destroy_process_group()
