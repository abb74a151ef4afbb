"""ParallelStage: the built GPT -> this rank's shard of it for training (TP, SP, PP, recompute).

The model definition stays engines/model/transformer.py. This file cuts a pipeline stage out of the built
model (layers [start, end), the embedding on the first stage, the final norm and the loss on the
last), slices its Linear layers with the engines' sharding plan (engines.parallel.tp.shard_spec),
swaps the attention for one that runs sequence-first with an optional recomputed core, and routes
dropout through the right generator. Parameter names stay the full model's (`blocks.3.attn.qkv.
weight`), so the sharding plan, the optimizer's decay rule and checkpoint export apply unchanged.

Activations are (T, B, C) inside a stage (a sequence shard is then a block of rows); under SP a
stage's input and output are (T/t, B, C).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engines.core.config import ModelConfig
from engines.model.dense_attention import causal_attention
from engines.model.transformer import GPT, apply_rope, rope_cache
from engines.parallel.layout import local_kv_heads
from engines.parallel.tp import shard_spec
from training.parallel.collectives import group_size, reduce_from_tp, scatter_seq
from training.parallel.groups import Groups
from training.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_loss,
)
from training.parallel.recompute import recompute
from training.parallel.rng import RNGTracker

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ParallelSpec:
    """How this rank runs its stage."""

    sequence_parallel: bool = False
    recompute: Recompute = "none"
    """selective: core attention (QK^T, softmax, dropout, x V) recomputed in backward; full: only
    each block's input kept, the block recomputed."""
    recompute_layers: int = 0
    """Recompute only the first k layers of each stage (Megatron's 'block' method); 0: all."""


class TrackedDropout(nn.Module):
    """Dropout drawing from the TP tracker's stream (split tensors) or the default one (replicated)."""

    def __init__(self, p: float, tracker: RNGTracker | None):
        super().__init__()
        self.p, self.tracker = p, tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork() if self.tracker is not None else contextlib.nullcontext():
            return F.dropout(x, self.p, True)


class ParallelAttention(nn.Module):
    """Sequence-first attention over this rank's heads: x (T or T/t, B, C) -> same shape."""

    def __init__(self, attn: nn.Module, cfg: ModelConfig, groups: Groups, spec: ParallelSpec,
                 tracker: RNGTracker | None, selective: bool):
        super().__init__()
        tp, r, g, sp = groups.layout.tp, groups.tp_rank, groups.tp_group, spec.sequence_parallel
        self.qkv = _column(attn.qkv, "attn.qkv.weight", cfg, tp, r, g, sp)
        self.proj = _row(attn.proj, "attn.proj.weight", cfg, tp, r, g, sp)
        self.n_head, self.n_kv_head, self.hd = cfg.n_head // tp, local_kv_heads(cfg, tp, r)[1], cfg.hd
        # qwen3's q/k norms: (hd,) weights shared by every head, so replicated; a rank's gradient
        # covers its own heads only, and grads.sync_grads sums them over the TP group
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.p = cfg.dropout
        self.tracker, self.selective = tracker, selective
        self.resid_drop = TrackedDropout(cfg.dropout, tracker if sp else None)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh/t, T, hd), k and v (B, nkv/t, T, hd) -> (B, nh/t, T, hd). The probabilities
        are split by head, so their dropout draws from the per-rank stream."""
        p = self.p if self.training else 0.0
        with self.tracker.fork() if p > 0 and self.tracker is not None else contextlib.nullcontext():
            return causal_attention(q, k, v, dropout_p=p)

    def forward(self, x: torch.Tensor, rope, backend=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output, plus residual when given (transformer.Block passes its input)."""
        qkv = self.qkv(x)  # (T, B, (nq + 2 nkv) hd): gathered to the whole sequence under SP
        T, B, _ = qkv.shape
        nq, nkv, hd = self.n_head, self.n_kv_head, self.hd
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(T, B, nq, hd), k.view(T, B, nkv, hd), v.view(T, B, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (B, heads, T, hd)
        y = recompute(self._core, self.tracker, q, k, v) if self.selective else self._core(q, k, v)
        y = y.permute(2, 0, 1, 3).reshape(T, B, nq * hd)  # (T, B, nh/t * hd)
        y = self.resid_drop(self.proj(y))
        return y if residual is None else residual + y


def _column(linear: nn.Linear, name: str, cfg, tp, r, group, sp) -> ColumnParallelLinear:
    spec = shard_spec(name, cfg, tp, r)
    w, b = linear.weight.detach(), linear.bias.detach() if linear.bias is not None else None
    if spec is not None:
        w, b = spec.take(w), spec.take(b) if b is not None else None
    out = ColumnParallelLinear(w.clone(), b.clone() if b is not None else None, group, sp)
    _mark(out.weight, out.bias, sharded=tp > 1)
    return out


def _row(linear: nn.Linear, name: str, cfg, tp, r, group, sp) -> RowParallelLinear:
    spec = shard_spec(name, cfg, tp, r)
    w = linear.weight.detach()
    w = spec.take(w) if spec is not None else w
    out = RowParallelLinear(w.clone(), linear.bias.detach().clone() if linear.bias is not None else None, group, sp)
    _mark(out.weight, sharded=tp > 1)
    return out


def _mark(*params, sharded: bool) -> None:
    """Sharded parameters count once per rank in the gradient norm; replicated ones once per group."""
    for p in params:
        if p is not None:
            p.tp_sharded = sharded


class _Head(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class ParallelStage(nn.Module):
    """Layers [start, end) of a GPT on one (tp_rank, pp_rank); the first stage embeds, the last
    returns the mean loss. Blocks are keyed by their global index."""

    def __init__(self, model: GPT, groups: Groups, spec: ParallelSpec, start: int, end: int,
                 tracker: RNGTracker | None):
        super().__init__()
        cfg: ModelConfig = model.cfg
        tp, r, g, sp = groups.layout.tp, groups.tp_rank, groups.tp_group, spec.sequence_parallel
        self.cfg, self.groups, self.spec, self.tracker = cfg, groups, spec, tracker
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == cfg.n_layer
        self.vp = cfg.vocab_size // tp
        self.vocab_start = r * self.vp
        vspec = shard_spec("wte.weight", cfg, tp, r)
        emb = model.wte.weight.detach()
        emb = (vspec.take(emb) if vspec is not None else emb).clone()
        self.wte = VocabParallelEmbedding(emb, self.vocab_start, self.vocab_start + self.vp) if self.first else None
        self.wpe = model.wpe if self.first else None
        self.drop = TrackedDropout(cfg.dropout, tracker if sp else None)
        self.blocks = nn.ModuleDict()
        for i in range(start, end):
            block = model.blocks[i]
            k = spec.recompute_layers or cfg.n_layer
            block.attn = ParallelAttention(block.attn, cfg, groups, spec, tracker,
                                           selective=spec.recompute == "selective" and i - start < k)
            block.mlp.up = _column(block.mlp.up, "mlp.up.weight", cfg, tp, r, g, sp)
            block.mlp.down = _row(block.mlp.down, "mlp.down.weight", cfg, tp, r, g, sp)
            block.mlp.drop = TrackedDropout(cfg.dropout, tracker if sp else None)
            block.full_recompute = spec.recompute == "full" and i - start < k
            self.blocks[str(i)] = block
        self.norm_f = model.norm_f if self.last else None
        self.lm_head = None
        if self.last:
            if cfg.tie_word_embeddings and self.first:
                self.lm_head = _Head(self.wte.weight)
            else:  # untied, or the last stage's copy of the tied embedding (kept in sync by grads.py)
                w = model.wte.weight if cfg.tie_word_embeddings else model.lm_head.weight
                w = w.detach()
                self.lm_head = _Head(nn.Parameter((vspec.take(w) if vspec is not None else w).clone()))
        for p in (self.wte.weight if self.wte else None, self.lm_head.weight if self.lm_head else None):
            _mark(p, sharded=tp > 1)
        self.current_layer = -1
        """The layer whose forward runs now (memory.py attributes saved tensors with it)."""

    def seq_len(self, x: torch.Tensor) -> int:
        """The whole sequence length T of a stage input: token ids (B, T) or hidden (T[/t], B, C)."""
        if self.first:
            return x.shape[1]
        return x.shape[0] * (group_size(self.groups.tp_group) if self.spec.sequence_parallel else 1)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: token ids (B, T); later: the previous stage's output. Returns the next stage's
        input, or on the last stage the mean loss over targets (B, T)."""
        cfg, g, sp = self.cfg, self.groups.tp_group, self.spec.sequence_parallel
        T = self.seq_len(x)
        if self.first:
            self.current_layer = -1
            e = self.wte(x.T)  # (T, B, C): partial, this rank's vocabulary rows only
            e = scatter_seq(e, g) if sp else reduce_from_tp(e, g)  # (T/t or T, B, C), summed
            if self.wpe is not None:
                n = e.shape[0]
                pos = torch.arange(n, device=e.device) + (self.groups.tp_rank * n if sp else 0)
                e = e + self.wpe(pos)[:, None, :]
            x = self.drop(e)
        rope = rope_cache(cfg, torch.arange(T, device=x.device)[:, None]) if cfg.uses_rope else None  # (T, 1, hd/2)
        for i, block in self.blocks.items():
            self.current_layer = int(i)
            if block.full_recompute:
                x = recompute(lambda y, b=block: b(y, rope, None), self.tracker, x)
            else:
                x = block(x, rope, None)
        self.current_layer = -1
        if not self.last:
            return x
        h = self.norm_f(x)
        return parallel_lm_loss(h, self.lm_head.weight, targets, self.vocab_start, self.vp, g, sp)

    def per_head_replicated(self) -> list[nn.Parameter]:
        """Replicated parameters applied per attention head (qwen3's q/k norms): each TP rank's
        gradient covers its own heads, so the gradients are summed over the group, SP or not."""
        return [p for b in self.blocks.values() for m in (b.attn.q_norm, b.attn.k_norm) if m is not None
                for p in m.parameters()]

    def replicated_under_sp(self) -> list[nn.Parameter]:
        """Parameters that are replicated across the TP group but see only a sequence shard under
        SP (norms, positions, row-parallel biases): their gradients are summed over the group."""
        return [p for p in self.parameters() if not getattr(p, "tp_sharded", False)]
