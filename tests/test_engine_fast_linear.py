"""The CPU kernel choices of engines/fast_linear.py compute exactly what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.fast_linear import KERNELS, apply_fast_linear


@pytest.mark.parametrize("kernel", ["pretransposed", "gemv"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 7, 48), (3, 5, 48)])
def test_kernels_match_linear(kernel, bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    fast = KERNELS[kernel](lin)
    x = torch.randn(*shape)
    torch.testing.assert_close(fast(x), lin(x), rtol=1e-5, atol=1e-5)


def test_apply_keeps_tied_head_and_outputs(gpt2_dir):
    from engines.checkpoint import load_model

    model, cfg = load_model(gpt2_dir)
    idx = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        before = model.logits(model(idx))
        choices = apply_fast_linear(model)
        after = model.logits(model(idx))
        one = model.logits(model(idx[:, :1]))
    assert set(choices.values()) <= set(KERNELS)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one[0, 0], before[0, 0], rtol=1e-5, atol=1e-5)
    if choices[(cfg.vocab_size, cfg.n_embd)] == "gemv":
        assert model.lm_head.weight is model.wte.weight
