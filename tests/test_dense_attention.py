"""The CPU causal attention used for training (engines/model/dense_attention.py) against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.model.dense_attention import causal_attention


def _grads(fn, q, k, v, g, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(g.to(dtype))
    return [out.detach().double()] + [x.grad.double() for x in leaves]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("nkv", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_matches_sdpa_in_fp32_and_fp64(nkv):
    torch.manual_seed(0)
    B, nh, T, hd = 2, 4, 37, 16
    q = torch.randn(B, nh, T, hd, dtype=torch.float64)
    k, v = torch.randn(B, nkv, T, hd, dtype=torch.float64), torch.randn(B, nkv, T, hd, dtype=torch.float64)
    g = torch.randn(B, nh, T, hd, dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for ours, ref in zip(_grads(causal_attention, q, k, v, g, dtype), _grads(_sdpa, q, k, v, g, torch.float64)):
            torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_bf16_error_is_of_the_order_of_sdpas_own():
    """In bf16 both kernels differ from the fp64 answer; ours may not be much further off."""
    torch.manual_seed(1)
    B, nh, T, hd = 2, 6, 128, 64
    q, k, v, g = (torch.randn(B, nh, T, hd, dtype=torch.float64) * s for s in (2.0, 2.0, 1.0, 1.0))
    exact = _grads(_sdpa, q, k, v, g, torch.float64)
    ours = _grads(causal_attention, q, k, v, g, torch.bfloat16)
    sdpa = _grads(_sdpa, q, k, v, g, torch.bfloat16)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact):
        err_ours, err_sdpa = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert err_ours < 3 * err_sdpa + 1e-3, (name, err_ours, err_sdpa)
        assert err_ours < 0.05, (name, err_ours)


def test_autocast_and_dropout_paths():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (1, 2, 9, 8)
    torch.testing.assert_close(y.float(), _sdpa(q, k, v), atol=3e-2, rtol=3e-2)
    # attention dropout is SDPA's: the result differs from the dropout-free one
    torch.manual_seed(3)
    out = causal_attention(q, k, v, dropout_p=0.5)
    assert out.shape == q.shape and torch.isfinite(out).all() and not torch.allclose(out, _sdpa(q, k, v))


@pytest.mark.parametrize("nkv", [4, 2])
def test_a_key_prefix_every_query_sees_matches_sdpa(nkv):
    """Tk > Tq (p-tuning of every layer): the first Tk - Tq keys are seen by every query, the rest
    causally: forward and gradients against SDPA with that mask, and the same rows as attention over
    the whole sequence."""
    torch.manual_seed(2)
    B, nh, T, P, hd = 2, 4, 9, 5, 16
    q = torch.randn(B, nh, T, hd, dtype=torch.float64)
    k, v = torch.randn(B, nkv, P + T, hd, dtype=torch.float64), torch.randn(B, nkv, P + T, hd, dtype=torch.float64)
    g = torch.randn(B, nh, T, hd, dtype=torch.float64)
    mask = torch.ones(T, P + T, dtype=torch.bool).tril(P)
    ref = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
    for ours, want in zip(_grads(causal_attention, q, k, v, g, torch.float32), _grads(ref, q, k, v, g, torch.float64)):
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    # the prefix form equals attention over the whole sequence, read at its last T rows
    qf = torch.cat([torch.randn(B, nh, P, hd, dtype=torch.float64), q], 2)
    whole = causal_attention(qf, k, v)[:, :, P:]
    torch.testing.assert_close(causal_attention(q, k, v), whole, atol=1e-12, rtol=1e-12)
