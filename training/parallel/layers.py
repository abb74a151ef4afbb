"""Tensor- and sequence-parallel layers for training; activations are (T, B, C), sequence first.

ColumnParallelLinear  y_r = x W_r^T + b_r: the output features split (QKV, MLP up). Without SP
                      the input is replicated and passes f (its gradient all-reduced). With SP
                      the input is this rank's sequence shard: it is all-gathered in forward,
                      and only the shard is saved; backward gathers it again for the weight
                      gradient and reduce-scatters the input gradient (the paper's g).
RowParallelLinear     y = sum_r x_r W_r^T + b: the input features split (attention out, MLP down);
                      the partial sums are all-reduced (g) or, with SP, reduce-scattered (g-bar).
VocabParallelEmbedding rows [start, end) of the vocabulary; other ids look up zeros.
vocab_parallel_cross_entropy  the loss from (N, V/t) logits per rank: the max, the sum of
                      exponentials and the target's logit are all-reduced, never the logits.

The weights are the engines' shard slices (engines.parallel.tp.shard_spec), so a training shard
and a serving shard hold the same rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.parallel.collectives import (
    all_gather_seq,
    all_reduce,
    copy_to_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_seq,
)


class _SeqParallelLinear(torch.autograd.Function):
    """all_gather(x_shard) @ W^T + b, saving x_shard (not the gathered input) for backward."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        dev = x_shard.device.type
        ctx.amp = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        ctx.save_for_backward(x_shard, weight)
        return F.linear(all_gather_seq(x_shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        x = all_gather_seq(x_shard, ctx.group)  # re-gathered: the price of saving 1/t of it
        grad = grad.contiguous()
        dev, dtype, enabled = ctx.amp
        with torch.autocast(dev, dtype=dtype, enabled=enabled):  # the forward's matmul precision
            grad_x = reduce_scatter_seq(grad @ weight, ctx.group)
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_w = g2.T @ x.reshape(-1, x.shape[-1])
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x.to(x_shard.dtype), grad_w.to(weight.dtype), grad_b, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out/t, in)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.group is not None:
            return _SeqParallelLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out, in/t)
        self.bias = nn.Parameter(bias) if bias is not None else None  # replicated, added once after the sum
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Partial embeddings: the caller sums them over the TP group (all-reduce, or reduce-scatter
    under SP), fused with the sequence split."""

    def __init__(self, weight: torch.Tensor, start: int, end: int):
        super().__init__()
        self.weight = nn.Parameter(weight)  # (Vp, C): rows [start, end), zero-padded to Vp
        self.start, self.end = start, end

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss from local logits (N, Vp) fp32; columns >= `valid` are padding."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, group):
        logits = logits.clone()  # becomes the softmax kept for backward (local columns only)
        if valid < logits.shape[1]:
            logits[:, valid:] = float("-inf")
        gmax = logits.max(dim=1).values
        all_reduce(gmax, group, dist.ReduceOp.MAX)
        logits.sub_(gmax[:, None])
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < valid)
        idx = local_t.clamp(0, logits.shape[1] - 1)
        rows = torch.arange(len(targets), device=logits.device)
        # the target's shifted logit z_t - max, from the rank that holds it (zero elsewhere)
        target = torch.where(mine, logits[rows, idx], torch.zeros_like(gmax))
        all_reduce(target, group)
        logits.exp_()
        sum_exp = all_reduce(logits.sum(dim=1), group)
        logits.div_(sum_exp[:, None])
        ctx.save_for_backward(logits, idx, mine)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad):
        probs, idx, mine = ctx.saved_tensors
        g = probs.clone()
        rows = torch.arange(len(idx), device=g.device)
        g[rows[mine], idx[mine]] -= 1.0
        return g * grad[:, None], None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int,
                                 group) -> torch.Tensor:
    """logits (N, Vp) of this rank's vocabulary rows [start, start + valid) -> per-token loss (N,)."""
    if group is None and valid == logits.shape[1] and start == 0:
        return F.cross_entropy(logits, targets, reduction="none")
    return _VocabParallelCE.apply(logits, targets, start, valid, group)


def parallel_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, start: int, valid: int,
                     group, sequence_parallel: bool) -> torch.Tensor:
    """Mean next-token loss: hidden (T/t or T, B, C) after the final norm, weight (Vp, C) this rank's
    vocabulary rows, targets (B, T)."""
    h = gather_seq(hidden, group) if sequence_parallel else copy_to_tp(hidden, group)  # (T, B, C)
    logits = F.linear(h, weight).float()  # (T, B, Vp): this rank's vocabulary only
    loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.T.reshape(-1), start, valid,
                                        group)
    return loss.mean()
