"""Gradient reductions of a parallel step, and the global gradient norm.

After the micro-batches' backward passes, in this order:
  1. SP: parameters replicated over the TP group but fed a sequence shard (norms, positions,
     row-parallel biases) hold partial gradients: summed over the TP group. Without SP, only
     the replicated parameters applied per head (qwen3's q/k norms) are partial, and summed.
  2. Tied embeddings across stages: the first stage's embedding and the last stage's copy of it
     both hold part of the gradient: summed over the pair, so both copies take the same update.
  3. Data parallel: averaged over the DP group, flattened into one buffer (one collective).
The global norm counts sharded parameters on every rank and replicated ones once (TP rank 0; the
last stage's tied copy not at all), summed over the model-parallel group: the single-process norm.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from training.parallel.collectives import all_reduce, group_size
from training.parallel.model import ParallelStage


def _reduce(grads: list[torch.Tensor], group, scale: float = 1.0) -> None:
    if group is None or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    all_reduce(flat, group)
    if scale != 1.0:
        flat.mul_(scale)
    for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(new)


def _tied_copy(stage: ParallelStage) -> torch.nn.Parameter | None:
    """The last stage's copy of a tied embedding (pp > 1), excluded from the norm."""
    if stage.cfg.tie_word_embeddings and stage.last and not stage.first:
        return stage.lm_head.weight
    return None


def sync_grads(stage: ParallelStage) -> None:
    g = stage.groups
    params = [p for p in stage.parameters() if p.grad is not None]
    if stage.spec.sequence_parallel and g.tp_group is not None:  # includes the per-head ones below
        _reduce([p.grad for p in stage.replicated_under_sp() if p.grad is not None], g.tp_group)
    elif g.tp_group is not None:
        _reduce([p.grad for p in stage.per_head_replicated() if p.grad is not None], g.tp_group)
    if stage.cfg.tie_word_embeddings and g.layout.pp > 1 and g.embed_group is not None:
        w = stage.wte.weight if stage.first else stage.lm_head.weight if stage.last else None
        if w is not None:
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            _reduce([w.grad], g.embed_group)
    n = group_size(g.dp_group)
    _reduce([p.grad for p in params], g.dp_group, 1.0 / n)


def global_grad_norm(stage: ParallelStage) -> torch.Tensor:
    g = stage.groups
    skip = _tied_copy(stage)
    total = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)
    for p in stage.parameters():
        if p.grad is None or p is skip:
            continue
        if getattr(p, "tp_sharded", False) or g.tp_rank == 0:
            total += p.grad.detach().double().pow(2).sum()
    return all_reduce(total, g.mp_group).sqrt()


def clip_grads(stage: ParallelStage, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model's shards; returns the global norm."""
    norm = global_grad_norm(stage)
    if max_norm > 0:
        coef = max_norm / (norm.item() + 1e-6)
        if coef < 1.0:
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm.float()
