"""Causal self-attention over whole sequences (training and plain forward passes), as batched matmuls.

`scaled_dot_product_attention` on a CPU runs a flash kernel whose backward computes in fp32
without AMX: for the default recipe (8 x 6 heads x 256 tokens x 64) its forward + backward take
~20 ms per layer, a quarter of a training step. Written as three batched matmuls, a softmax and
its fused backward, the matmuls run on AMX in bf16 and the step's attention takes ~9 ms. The
(T, T) probabilities are kept for the backward (6 MB per layer at that shape), which a flash
kernel avoids; at training lengths of a few hundred tokens that is the better trade on a CPU.

Precision follows the inputs: in fp32 everything is fp32; in bf16 the scores and probabilities
are bf16 (the softmax itself reduces in fp32), as the matmuls around them are.

`causal_attention` chooses: this path on CPU when no attention dropout is asked for, SDPA
otherwise (CUDA has fused flash kernels that beat it; dropout needs SDPA's masks).

Keys may be longer than queries (Tk > Tq): the first Tk - Tq keys/values are a prefix every query
sees (p-tuning of every layer trains its virtual tokens' keys/values without running the model on
those positions, training/ptune.py); query i sees keys up to Tk - Tq + i.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=16)
def _causal_mask(tq: int, tk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) additive mask: 0 where query i may see key j (j <= Tk - Tq + i), -inf elsewhere."""
    return torch.full((tq, tk), float("-inf"), device=device).triu(1 + tk - tq).to(dtype)


class _CausalAttention(torch.autograd.Function):
    """q (N, Tq, hd), k and v (N, Tk, hd) with the same head count -> (N, Tq, hd)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        mask = _causal_mask(q.shape[1], k.shape[1], q.dtype, q.device)
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)  # (N, Tq, Tk)
        probs = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return torch.bmm(probs, v)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, probs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_v = torch.bmm(probs.transpose(1, 2), grad)
        grad_probs = torch.bmm(grad, v.transpose(1, 2))
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        zero = grad_scores.new_zeros(1, 1, 1)  # beta=0: the scale rides in the matmul's alpha, no extra pass
        grad_q = torch.baddbmm(zero, grad_scores, k, beta=0, alpha=ctx.scale)
        grad_k = torch.baddbmm(zero, grad_scores.transpose(1, 2), q, beta=0, alpha=ctx.scale)
        return grad_q, grad_k, grad_v, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """q (B, nh, Tq, hd), k and v (B, nkv, Tk, hd) with nh a multiple of nkv and Tk >= Tq (a prefix of
    Tk - Tq keys every query sees) -> (B, nh, Tq, hd)."""
    B, nh, T, hd = q.shape
    nkv, tk = k.shape[1], k.shape[2]
    if q.device.type != "cpu" or dropout_p > 0.0:
        # SDPA's is_causal aligns the diagonal top-left; with a prefix the mask is explicit
        mask = None if tk == T else torch.ones(T, tk, dtype=torch.bool, device=q.device).tril(tk - T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p,
                                              enable_gqa=nkv != nh)
    with torch.autocast("cpu", enabled=False):
        dtype = torch.promote_types(q.dtype, k.dtype)
        if nkv != nh:  # grouped-query: each kv head serves nh // nkv query heads (autograd sums them back)
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        q3, k3, v3 = (x.to(dtype).reshape(B * nh, -1, hd) for x in (q, k, v))
        return _CausalAttention.apply(q3, k3, v3, hd ** -0.5).view(B, nh, T, hd)
