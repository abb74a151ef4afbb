"""Tensor parallelism as a transformation of the built model (Megatron layout, gpt-fast style).

Per block: the fused QKV projection is column-parallel (each rank keeps its query heads and
their key/value heads, q, k and v sliced separately from the fused rows); the output projection
is row-parallel and all-reduces; the MLP's up projection (llama: fused [gate; up], each half
sliced) is column-parallel and its down projection row-parallel with an all-reduce. The
embedding and the LM head are split by vocabulary. Two all-reduces of (tokens x hidden) per
layer, plus one after the embedding.

`shard_spec` is the one sharding plan: `apply_tp` slices in-memory weights with it and the
sharded loader (sharded_loading.py) reads exactly those slices from the safetensors files. A layer
of another transform (FP8 storage) shards itself through `ShardableLinear`; TP knows no such class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engines.core.config import ModelConfig
from engines.parallel.comm import Comm
from engines.parallel.layout import local_kv_heads, padded_vocab


@dataclass(frozen=True)
class ShardSpec:
    """Which part of a full parameter a rank keeps: ranges along `dim`, concatenated, and then
    zero rows appended up to `pad_to` (vocabulary shards of unequal size)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int = 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The rank's part of the full tensor `t` (works on meta tensors too)."""
        if t.is_meta and (len(self.ranges) > 1 or self.pad_to):
            # only the shape: torch.cat of meta tensors runs a Python decomposition whose first call imports
            # torch._dynamo (3.5-4 s of a 2-core host, ~10 s under load, in every TP shard's start: load_shard
            # builds the sharded model on meta; nothing else a shard runs needs dynamo)
            shape = list(t.shape)
            shape[self.dim] = self.size
            if self.pad_to and shape[0] < self.pad_to:
                shape[0] = self.pad_to
            return torch.empty(shape, dtype=t.dtype, device=t.device)
        parts = [t.narrow(self.dim, a, b - a) for a, b in self.ranges]
        out = torch.cat(parts, self.dim) if len(parts) > 1 else parts[0]
        if self.pad_to and out.shape[0] < self.pad_to:
            pad = torch.zeros((self.pad_to - out.shape[0], *out.shape[1:]), dtype=t.dtype, device=t.device)
            out = torch.cat([out, pad], 0)
        return out

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


def shard_spec(name: str, cfg: ModelConfig, tp: int, tp_rank: int) -> ShardSpec | None:
    """The slice of parameter `name` (our naming) kept by `tp_rank`; None when it is replicated."""
    if tp == 1:
        return None
    hd, nh = cfg.hd, cfg.n_head
    nq = nh // tp
    kv0, nkv = local_kv_heads(cfg, tp, tp_rank)
    f = cfg.ffn_dim // tp
    if name in ("wte.weight", "lm_head.weight"):
        vp = padded_vocab(cfg, tp)
        start = min(cfg.vocab_size, tp_rank * vp)
        return ShardSpec(0, ((start, min(cfg.vocab_size, start + vp)),), pad_to=vp)
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        k_off, v_off = nh * hd, (nh + cfg.kv_heads) * hd
        return ShardSpec(0, ((tp_rank * nq * hd, (tp_rank + 1) * nq * hd),
                             (k_off + kv0 * hd, k_off + (kv0 + nkv) * hd),
                             (v_off + kv0 * hd, v_off + (kv0 + nkv) * hd)))
    if name.endswith("attn.proj.weight"):
        return ShardSpec(1, ((tp_rank * nq * hd, (tp_rank + 1) * nq * hd),))
    if name.endswith(("mlp.up.weight", "mlp.up.bias")):
        own = (tp_rank * f, (tp_rank + 1) * f)
        if cfg.activation == "silu":  # fused [gate; up]: the same columns of each half
            F_ = cfg.ffn_dim
            return ShardSpec(0, (own, (F_ + own[0], F_ + own[1])))
        return ShardSpec(0, (own,))
    if name.endswith("mlp.down.weight"):
        return ShardSpec(1, ((tp_rank * f, (tp_rank + 1) * f),))
    return None  # norms, positions, row-parallel biases: replicated


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input features are split across ranks and the
    bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight), "tp_layer")
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; other ids look up zeros, and the sum over ranks is the
    full lookup."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (Vp, C), zero-padded past end - start
        self.start, self.end, self.comm = start, end, comm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:
            return F.embedding(idx, self.weight)
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)  # (B, T, C)
        return self.comm.all_reduce(x, "tp_embed")


class VocabParallelHead(nn.Module):
    """LM head rows [start, end): logits of this rank's vocabulary slice, padding set to -inf."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (Vp, C)
        self.start, self.end, self.vocab_size = start, end, vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., C) -> local logits (..., Vp) in fp32."""
        logits = F.linear(h, self.weight).float()
        valid = self.end - self.start
        if valid < logits.shape[-1]:
            logits[..., valid:] = float("-inf")
        return logits


@runtime_checkable
class ShardableLinear(Protocol):
    """A Linear-like layer that knows how to keep a rank's slice of itself (FP8 storage keeps the
    scales of its rows, for one). apply_tp asks a layer that has these methods for its shard and
    slices a plain nn.Linear itself, so TP never names another transform's layer class."""

    def shard_columns(self, spec: ShardSpec) -> nn.Module:
        """The rank's output rows `spec` (column-parallel: no collective after the matmul)."""
        ...

    def shard_rows(self, spec: ShardSpec, comm: Comm) -> nn.Module:
        """The rank's input columns `spec` (row-parallel: all-reduced over `comm`, bias added after)."""
        ...


def _column(linear: nn.Module, spec: ShardSpec) -> nn.Module:
    if isinstance(linear, ShardableLinear):
        return linear.shard_columns(spec)
    w = spec.take(linear.weight.detach())
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(spec.take(linear.bias.detach()), requires_grad=False)
    return out


def _row(linear: nn.Module, spec: ShardSpec, comm: Comm) -> nn.Module:
    if isinstance(linear, ShardableLinear):
        return linear.shard_rows(spec, comm)
    bias = linear.bias.detach() if linear.bias is not None else None
    return RowParallelLinear(spec.take(linear.weight.detach()), bias, comm)


def apply_tp(model: nn.Module, cfg: ModelConfig, comm: Comm) -> nn.Module:
    """Shard `model` (a GPT or a pipeline StageModel, full weights or on the meta device) in place
    for TP rank comm.tp_rank of comm.tp_size; returns it. With tp_size 1 the embedding and head are
    still wrapped (identity collectives), so a sharded runner treats every layout alike."""
    tp, r = comm.tp_size, comm.tp_rank
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        if tp > 1:  # the specs depend on the parameter's kind, not on its layer
            attn.qkv = _column(attn.qkv, shard_spec("attn.qkv.weight", cfg, tp, r))
            attn.proj = _row(attn.proj, shard_spec("attn.proj.weight", cfg, tp, r), comm)
            attn.n_head = cfg.n_head // tp
            attn.n_kv_head = local_kv_heads(cfg, tp, r)[1]
            mlp.up = _column(mlp.up, shard_spec("mlp.up.weight", cfg, tp, r))
            mlp.down = _row(mlp.down, shard_spec("mlp.down.weight", cfg, tp, r), comm)
    vp = padded_vocab(cfg, tp)
    start, end = min(cfg.vocab_size, r * vp), min(cfg.vocab_size, (r + 1) * vp)
    tied = cfg.tie_word_embeddings and getattr(model, "wte", None) is not None and getattr(model, "lm_head", None) is not None
    spec = shard_spec("wte.weight", cfg, tp, r) or ShardSpec(0, ((0, cfg.vocab_size),))
    if getattr(model, "wte", None) is not None and not isinstance(model.wte, VocabParallelEmbedding):
        model.wte = VocabParallelEmbedding(spec.take(model.wte.weight.detach()), start, end, comm)
    if getattr(model, "lm_head", None) is not None and not isinstance(model.lm_head, VocabParallelHead):
        w = model.wte.weight if tied else spec.take(model.lm_head.weight.detach())
        model.lm_head = VocabParallelHead(w, start, end, cfg.vocab_size)
        if tied:
            model.lm_head.weight = model.wte.weight
    return model
