"""The CPU kernel choices of engines/fast_linear.py compute exactly what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.fast_linear import KERNELS, SlicedWideLinear, apply_fast_linear


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
    assert {c.split("+")[0] for c in choices.values()} <= set(KERNELS)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one[0, 0], before[0, 0], rtol=1e-5, atol=1e-5)
    if choices[(cfg.vocab_size, cfg.n_embd)].startswith("gemv"):
        assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("inner", ["linear", "pretransposed", "gemv"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 7, 48), (3, 5, 48)])
def test_sliced_wide_linear_matches_linear(inner, bias, shape):
    """Slices of the output features (the last one short) give what one nn.Linear call gives."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    kernel = KERNELS[inner]
    sliced = SlicedWideLinear(lin if kernel is None else kernel(lin), lin.weight, lin.bias, chunk=24)
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(sliced(x), lin(x), rtol=1e-5, atol=1e-5)


def test_wide_head_choice_keeps_the_tie_and_outputs(monkeypatch, gpt2_dir):
    """A head that qualifies as wide (threshold lowered to the test model's vocabulary) and is
    forced sliced keeps its tie to the embedding and the model's logits."""
    import engines.fast_linear as fl
    from engines.checkpoint import load_model

    model, cfg = load_model(gpt2_dir)
    monkeypatch.setattr(fl, "WIDE_MIN_OUT", cfg.vocab_size)
    monkeypatch.setattr(fl, "choose_wide_kernel", lambda *a, **k: True)
    idx = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        before = model.logits(model(idx))
        choices = fl.apply_fast_linear(model)
        after = model.logits(model(idx))
    assert isinstance(model.lm_head, SlicedWideLinear) and choices[(cfg.vocab_size, cfg.n_embd)].endswith("+sliced")
    assert model.lm_head.weight is model.wte.weight
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
