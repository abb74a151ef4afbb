"""Next-token cross-entropy fused with the output projection, computed in row chunks.

The plain path (`F.cross_entropy(model.logits(hidden), targets)`) materialises (N, V) logits in
fp32 and then walks them half a dozen times: upcast, log-softmax, a zero-filled gradient,
log-softmax backward, downcast for the weight gradient. With V = 8192 that traffic, not the
matmul, dominates the head on a CPU. Here each chunk of rows goes matmul -> fp32 softmax ->
gradient while it is in cache; only the gradient of the logits (in the matmul dtype) is written
once, and two large matmuls turn it into the hidden and weight gradients. The logits are the
same as `model.logits` (the lm_head matmul in `compute_dtype`, read in fp32).
"""

from __future__ import annotations

import torch


def _chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    # CPU: the fp32 logits of one chunk stay within about one core's L2 cache;
    # GPU: large chunks (few kernel launches), still far below the full logits
    budget = 2 * 2**20 if device.type == "cpu" else 512 * 2**20
    return max(16, min(n_rows, budget // (4 * vocab)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype) -> torch.Tensor:
        n, vocab = hidden.shape[0], weight.shape[0]
        h = hidden.to(compute_dtype)  # (N, C)
        w = weight.to(compute_dtype)  # (V, C)
        dlogits = torch.empty(n, vocab, dtype=compute_dtype, device=hidden.device)  # d(mean loss)/d(logits)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(n, vocab, hidden.device)
        for s in range(0, n, step):
            t = targets[s:s + step]
            logits = (h[s:s + step] @ w.T).float()  # (n_c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (n_c,)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            probs.scatter_add_(1, t[:, None], torch.full((len(t), 1), -1.0, device=probs.device))
            dlogits[s:s + step] = probs.mul_(1.0 / n)
        ctx.save_for_backward(h, w, dlogits)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, w, dlogits = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_out.to(dlogits.dtype)
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = (dlogits @ w).mul_(scale).to(hidden_dtype)  # (N, C)
        if ctx.needs_input_grad[1]:
            grad_w = (dlogits.T @ h).mul_(scale).to(weight_dtype)  # (V, C)
        return grad_h, grad_w, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         compute_dtype: torch.dtype = torch.float32, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits = hidden @ weight.T (matmul in compute_dtype, softmax in fp32).

    hidden (N, C), weight (V, C), targets (N,) int64. reduction "mean" or "sum".
    """
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            loss = _LinearCrossEntropy.apply(hidden, weight, targets, compute_dtype)
            return loss * hidden.shape[0] if reduction == "sum" else loss
        # evaluation: the same chunks, no gradient buffer
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(h.shape[0], w.shape[0], h.device)
        for s in range(0, h.shape[0], step):
            logits = (h[s:s + step] @ w.T).float()
            total += (torch.logsumexp(logits, -1) - logits.gather(1, targets[s:s + step, None]).squeeze(1)).sum()
        return total if reduction == "sum" else total / h.shape[0]
