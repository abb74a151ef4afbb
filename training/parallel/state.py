"""Full tensors from shards: export and tests see the single-process model, whatever the layout.

`tp_full` all-gathers each sharded tensor of a stage over its TP group and puts the pieces where
the sharding plan (engines.parallel.tp.shard_spec) took them from. `gather_model` collects every
stage's tensors on rank 0 (DP replica 0), dropping the last stage's copy of a tied embedding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engines.model.transformer import GPT
from engines.parallel.tp import shard_spec
from training.parallel.collectives import group_size
from training.parallel.model import ParallelStage


def _full_shapes(stage: ParallelStage) -> dict[str, torch.Size]:
    with torch.device("meta"):
        ref = GPT(stage.cfg)
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    shapes.setdefault("lm_head.weight", ref.lm_head.weight.shape)
    return shapes


def tp_full(stage: ParallelStage, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> this rank's shard of a parameter (or its gradient) => name -> the full tensor."""
    g, cfg = stage.groups, stage.cfg
    tp = g.layout.tp
    shapes = _full_shapes(stage)
    out = {}
    for name, t in values.items():
        spec = shard_spec(name, cfg, tp, g.tp_rank)
        if spec is None or tp == 1:
            out[name] = t.detach().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(group_size(g.tp_group))]
        dist.all_gather(parts, t.detach().contiguous(), group=g.tp_group)
        full = torch.zeros(shapes[name], dtype=t.dtype, device=t.device)
        for r, part in enumerate(parts):
            s, at = shard_spec(name, cfg, tp, r), 0
            for a, b in s.ranges:
                full.narrow(s.dim, a, b - a).copy_(part.narrow(s.dim, at, b - a))
                at += b - a
        out[name] = full
    return out


def stage_tensors(stage: ParallelStage, grads: bool = False) -> dict[str, torch.Tensor]:
    """This stage's parameters (or gradients, zeros where none) by full-model name, each once."""
    out, seen = {}, set()
    for name, p in stage.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name] = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
    if stage.cfg.tie_word_embeddings and stage.last and not stage.first:
        out.pop("lm_head.weight", None)  # the first stage's wte is the tied weight
    return out


def gather_model(stage: ParallelStage, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's tensors (CPU) on global rank 0; None elsewhere. Collective over the world."""
    g = stage.groups
    full = {k: v.cpu() for k, v in tp_full(stage, stage_tensors(stage, grads)).items()}
    if g.layout.world == 1:
        return full
    mine = full if (g.tp_rank == 0 and g.dp_rank == 0) else None
    got = [None] * g.layout.world if dist.get_rank() == 0 else None
    dist.gather_object(mine, got, dst=0)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in got:
        out.update(part or {})
    return out


def assemble_shards(shard_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """Offline: (recipe dict, full model tensors) from a parallel run's checkpoint folder
    (layout.json + rank-NNNNN.safetensors), placing each shard where shard_spec took it from."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from engines.core.config import ModelConfig
    from training.parallel.groups import Layout
    from training.recipe import recipe_from_dict
    from training.state import read_meta

    shard_dir = Path(shard_dir)
    lay = json.loads((shard_dir / "layout.json").read_text())
    layout = Layout(lay["tp"], lay["pp"], lay["dp"])
    recipe_d = read_meta(shard_dir / "rank-00000.safetensors")["recipe"]
    cfg: ModelConfig = recipe_from_dict(recipe_d).model
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPT(cfg).named_parameters()}
    full: dict[str, torch.Tensor] = {}
    for rank in range(layout.world):
        tp_rank, dp_rank, _ = layout.coords(rank)
        if dp_rank:
            continue
        with safe_open(shard_dir / f"rank-{rank:05d}.safetensors", framework="pt") as f:
            for key in f.keys():
                if not key.startswith("model."):
                    continue
                name = key[len("model."):]
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # the last stage's copy of the tied embedding
                t = f.get_tensor(key)
                spec = shard_spec(name, cfg, layout.tp, tp_rank)
                if spec is None or layout.tp == 1:
                    full[name] = t
                    continue
                dst = full.setdefault(name, torch.zeros(shapes[name], dtype=t.dtype))
                at = 0
                for a, b in spec.ranges:
                    dst.narrow(spec.dim, a, b - a).copy_(t.narrow(spec.dim, at, b - a))
                    at += b - a
    return recipe_d, full
