"""The collectives of tensor and sequence parallelism as autograd functions (Megatron's f, g, g-bar).

    copy_to_tp        f:     identity forward,              all-reduce backward   (before a column-parallel layer)
    reduce_from_tp    g:     all-reduce forward,            identity backward     (after a row-parallel layer)
    gather_seq        g:     all-gather the sequence,       reduce-scatter back   (SP, before column-parallel)
    scatter_seq       g-bar: reduce-scatter the sequence,   all-gather back       (SP, after row-parallel)

Activations are (T, B, C), sequence first, so a sequence shard is one contiguous block of rows
(rank r holds rows [r T/t, (r+1) T/t)) and gathers need no copies. The group is an argument; a
group of None is a world of one, where every function is the identity. The same calls run on gloo
and NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(T/t, ...) shards -> (T, ...), rank order along dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(T, ...) partial sums -> this rank's (T/t, ...) rows of their sum."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ScatterSeq.apply(x, group)
