"""`shardserve tune train`: the fastest Megatron layout for a training recipe on N devices.

    enumerate  TP (divisors of N the model splits by) x PP (divisors of N / TP, <= layers) x SP (with
               TP > 1) x recompute (none, selective, full) x micro-batch (divisors of the per-replica batch)
    prune      a per-rank memory estimate against the device memory: weights, gradients and AdamW state
               (16 bytes per fp32 parameter of the rank's shard) + activations (Korthikanti et al.'s
               per-layer formulas, fp32 and dropout off as in training/parallel/memory.py, times the
               layers of the first stage and the micro-batches it keeps in flight) + the loss's logits
    time       every survivor for a few steps on N local ranks (gloo on CPU, NCCL on GPUs), in one
               process group: tokens/s from the slowest rank's step time
    report     the candidates sorted by speed with tokens/s and MFU, where MFU is model FLOPs per
               second (6 x params + 12 x layers x hidden x seq per token, recomputation not counted)
               over N x the matmul peak measured on one rank in the same run; writes the best recipe.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    recompute: str
    micro_batch_size: int

    @property
    def label(self) -> str:
        return (f"TP{self.tp} PP{self.pp} DP{self.dp}{' SP' if self.sequence_parallel else ''} "
                f"rc={self.recompute} mb={self.micro_batch_size}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def param_count(cfg) -> int:
    import torch

    from engines.model.transformer import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def memory_estimate(cfg, c: Candidate, seq_len: int, batch_size: int) -> float:
    """Peak bytes on the busiest rank (the first stage): see the module docstring."""
    from training.parallel.memory import formula_bytes

    params = param_count(cfg)
    embed = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_word_embeddings else 2)
    per_rank_params = (params - embed) / (c.tp * c.pp) + embed / c.tp
    variant = ("full" if c.recompute == "full" else
               {(False, "none"): "tp", (True, "none"): "tp_sp", (False, "selective"): "tp_sar",
                (True, "selective"): "tp_sp_sar"}[(c.sequence_parallel, c.recompute)])
    if c.tp == 1 and variant != "full":
        variant = "none" if c.recompute == "none" else "tp_sar"
    layer = formula_bytes(variant, seq_len, c.micro_batch_size, cfg.n_embd, cfg.n_head, c.tp)
    if variant == "full" and c.sequence_parallel:
        layer /= c.tp
    micro = batch_size // (c.dp * c.micro_batch_size)
    in_flight = min(c.pp, micro)  # 1F1B: stage 0 keeps pp micro-batches' activations
    layers = -(-cfg.n_layer // c.pp)
    logits = 2 * 4 * seq_len * c.micro_batch_size * cfg.vocab_size / c.tp if c.pp == 1 else 0
    return 16 * per_rank_params + layer * layers * in_flight + logits


def enumerate_candidates(cfg, seq_len: int, batch_size: int, devices: int) -> list[Candidate]:
    from engines.core.config import ConfigError
    from training.parallel.setup import check_layout

    out = []
    for tp, pp in itertools.product(_divisors(devices), _divisors(devices)):
        if devices % (tp * pp):
            continue
        dp = devices // (tp * pp)
        try:
            check_layout(cfg, seq_len, tp, pp, False, devices)
        except ConfigError:
            continue
        if batch_size % dp:
            continue
        for sp, rc in itertools.product((False, True) if tp > 1 else (False,), RECOMPUTE):
            if sp and seq_len % tp:
                continue
            for mb in _divisors(batch_size // dp):
                out.append(Candidate(tp, pp, dp, sp, rc, mb))
    return out


def _matmul_peak(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an fp32 n x n matmul on this rank (the ceiling MFU is quoted against)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def _time_worker(cfg_dict: dict, seq_len: int, batch_size: int, cands: list[dict], steps: int, out: str) -> None:
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
    from training.recipe import OptimSpec

    cfg = ModelConfig(**{**cfg_dict, "eos_token_id": tuple(cfg_dict.get("eos_token_id") or ())})
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    peak = _matmul_peak()
    rows = []
    for d in cands:
        c = Candidate(**d)
        groups = build_groups(Layout.for_world(world, c.tp, c.pp), rank)
        stage = build_stage(cfg, 0, groups, ParallelSpec(c.sequence_parallel, c.recompute), torch.device("cpu"))
        opt = build_optimizer(stage, OptimSpec())
        micro = batch_size // (c.dp * c.micro_batch_size)
        g = torch.Generator().manual_seed(groups.dp_rank)
        ids = torch.randint(0, cfg.vocab_size, (micro, c.micro_batch_size, seq_len + 1), generator=g)
        batches = [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(micro)]
        shape = (seq_len // c.tp if c.sequence_parallel else seq_len, c.micro_batch_size, cfg.n_embd)
        times = []
        for step in range(steps + 1):  # the first step warms up (allocations, first-touch)
            t = time.perf_counter()
            run_step(stage, batches, "1f1b", shape, lambda: torch.autocast("cpu", enabled=False))
            sync_grads(stage)
            clip_grads(stage, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = torch.tensor([time.perf_counter() - t])
            if world > 1:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step:
                times.append(dt.item())
        rows.append({**d, "step_s": sorted(times)[len(times) // 2]})
        del stage, opt
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "peak_flops_per_rank": peak}))
    if world > 1:
        dist.destroy_process_group()


def search(recipe, devices: int, device_memory_gib: float, steps: int = 2, log=print) -> dict:
    """Enumerate, prune, time; returns {"timed": rows sorted fastest first, "pruned": [...], ...}."""
    import tempfile

    from training.distributed import spawn_local

    cfg, s, B = recipe.model, recipe.data.seq_len, recipe.train.batch_size
    cands = enumerate_candidates(cfg, s, B, devices)
    if not cands:
        raise ValueError(f"no layout of {devices} devices fits the model (see `shardserve train` errors)")
    budget = device_memory_gib * 2**30
    fits = [c for c in cands if memory_estimate(cfg, c, s, B) <= budget]
    pruned = [c for c in cands if c not in fits]
    if not fits:
        smallest = min(cands, key=lambda c: memory_estimate(cfg, c, s, B))
        raise ValueError(f"--device-memory-gib: no layout fits {device_memory_gib:g} GiB per device; the smallest "
                         f"estimate is {memory_estimate(cfg, smallest, s, B) / 2**30:.3f} GiB ({smallest.label})")
    log(f"{len(cands)} candidates, {len(pruned)} pruned by the memory estimate ({device_memory_gib:g} GiB per device), "
        f"timing {len(fits)} for {steps} step(s) each on {devices} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        args = (json.loads(json.dumps(cfg.__dict__)), s, B, [asdict(c) for c in fits], steps, out)
        if devices == 1:
            _time_worker(*args)
        else:
            spawn_local(_time_worker, devices, args)
        res = json.loads(Path(out).read_text())
    flops_per_token = 6 * param_count(cfg) + 12 * cfg.n_layer * cfg.n_embd * s
    peak = res["peak_flops_per_rank"] * devices
    rows = []
    for r in res["rows"]:
        tok_s = B * s / r["step_s"]
        rows.append({**r, "tokens_per_s": tok_s, "mfu": tok_s * flops_per_token / peak,
                     "memory_gib": memory_estimate(cfg, Candidate(**{k: r[k] for k in asdict(fits[0])}), s, B) / 2**30})
    rows.sort(key=lambda r: r["step_s"])
    return {"timed": rows, "pruned": [asdict(c) for c in pruned], "peak_flops": peak}


def tune_train(
    config: Path = typer.Option(..., "--config", "-c", help="Training recipe YAML to find a layout for."),
    devices: int = typer.Option(..., "--devices", min=1, help="Ranks (devices) the run will have."),
    device_memory_gib: float = typer.Option(
        0.0, help="Memory per device for the pruning estimate [default: this host's RAM / devices]."),
    steps: int = typer.Option(2, min=1, help="Timed steps per candidate (after one warm-up step)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the best layout's recipe here."),
    set_: list[str] | None = typer.Option(None, "--set", help="Override a recipe value (repeatable)."),
) -> None:
    """Search TP / PP / SP / recompute / micro-batch layouts of a training recipe: prune by a memory
    estimate, time the survivors on local ranks, report tokens/s and MFU, write the fastest as a recipe."""
    import os

    import yaml

    from engines.core.config import ConfigError
    from training.recipe import load_recipe

    try:
        recipe = load_recipe(config, set_ or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    mem = device_memory_gib or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / devices
    try:
        res = search(recipe, devices, mem, steps, log=typer.echo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{'layout':<40} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'est. GiB':>9}")
    for r in res["timed"]:
        c = Candidate(**{k: r[k] for k in ("tp", "pp", "dp", "sequence_parallel", "recompute", "micro_batch_size")})
        typer.echo(f"{c.label:<40} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>7.2%} "
                   f"{r['memory_gib']:>9.3f}")
    best = res["timed"][0]
    label = Candidate(**{k: best[k] for k in ("tp", "pp", "dp", "sequence_parallel", "recompute",
                                              "micro_batch_size")}).label
    typer.echo(f"fastest: {label}, {best['tokens_per_s']:.0f} tokens/s, "
               f"MFU {best['mfu']:.2%} (peak {res['peak_flops'] / 1e9:.0f} GFLOP/s over {devices} ranks, measured)")
    if out is not None:
        d = recipe.to_dict()
        d["train"].update(tensor_parallel_size=best["tp"], pipeline_parallel_size=best["pp"],
                          sequence_parallel=best["sequence_parallel"], recompute=best["recompute"],
                          micro_batch_size=best["micro_batch_size"])
        out.write_text(yaml.safe_dump(d, sort_keys=False))
        typer.echo(f"wrote {out}: run it with `shardserve train --config {out} --num-workers {devices}`")
