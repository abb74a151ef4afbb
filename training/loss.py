"""Next-token cross-entropy fused with the output projection.

The plain path (`F.cross_entropy(model.logits(hidden), targets)`) materialises (N, V) logits in
fp32 and then walks them half a dozen times: upcast, log-softmax, a zero-filled gradient,
log-softmax backward, downcast for the weight gradient. With V = 8192 that traffic, not the
matmul, dominates the head on a CPU. Here the logits come from one matmul in the matmul dtype,
into the buffer that then holds their gradient: each cache-sized chunk of rows is replaced by its
fp32 softmax in one fused pass (rounded back to the matmul dtype), and the targets' own entries
get p - 1 from the fp32 probability. Two large matmuls turn it into the hidden and weight
gradients. The logits are the same as `model.logits` (the lm_head matmul in `compute_dtype`, read
in fp32).
"""

from __future__ import annotations

import torch


def _chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    """Rows whose fp32 softmax is computed at once. CPU: within the two cores' L2 caches (measured
    best); GPU: large chunks (few kernel launches), still far below the full logits."""
    budget = 4 * 2**20 if device.type == "cpu" else 512 * 2**20
    return max(16, min(n_rows, budget // (4 * vocab)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype) -> torch.Tensor:
        n, vocab = hidden.shape[0], weight.shape[0]
        h = hidden.to(compute_dtype)  # (N, C)
        w = weight.to(compute_dtype)  # (V, C)
        dlogits = h @ w.T  # the logits, replaced in place by N x d(mean loss)/d(logits)
        p_target = torch.empty(n, dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(n, vocab, hidden.device)
        for s in range(0, n, step):
            probs = torch.softmax(dlogits[s:s + step], dim=-1, dtype=torch.float32)  # (n_c, V), one fused pass
            dlogits[s:s + step] = probs
            p_target[s:s + step] = probs.gather(1, targets[s:s + step, None]).squeeze(1)
        # the target's own gradient, p - 1, from the fp32 probability (not its rounded copy)
        dlogits[torch.arange(n, device=hidden.device), targets] = (p_target - 1.0).to(compute_dtype)
        logp_target = p_target.log()
        lost = (p_target < 1e-30).nonzero().squeeze(1)  # an fp32 probability this small has lost digits:
        if len(lost):  # those rows' log-probabilities again, from the log-sum-exp (rare: a ~70-nat miss)
            logits = (h[lost] @ w.T).float()
            logp_target[lost] = logits.gather(1, targets[lost, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(h, w, dlogits)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return -logp_target.sum() / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, w, dlogits = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = (grad_out / h.shape[0]).to(dlogits.dtype)  # the mean's 1/N, applied to (N, C)-sized results
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
