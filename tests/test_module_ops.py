"""The module path's C++ SwiGLU (engines/cpu/module_ops.py, csrc/fused_decode.cpp swiglu_rows: 16 lanes at a time
for bf16 and fp32, a scalar tail) against torch's silu(gate) * up, special values included: bf16 bit for bit; fp32
within the exponential's error (its 16-lane polynomial, ~2e-7 relative)."""

import pytest
import torch
import torch.nn.functional as F

from engines.cpu import kernels, module_ops

pytestmark = pytest.mark.skipif(kernels.load()[0] is None, reason="the C++ kernels cannot be built here")

SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 3.0e38, -3.0e38,
           1e-3, -1e-3, 20.0, -20.0, 0.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "ffn"), [(1, 1536), (5, 37), (64, 272), (3, 16)])
def test_swiglu_equals_torch(dtype, rows, ffn):
    """Random rows, some scaled far out, and every special value as gate and as up (NaN, infinities, signed zeros,
    denormals, the exponential's ends); ffn not a multiple of 16 exercises the scalar tail after the vector lanes."""
    g = torch.Generator().manual_seed(rows * 1000 + ffn)
    h = torch.randn(rows, 2 * ffn, generator=g) * torch.logspace(-3, 2, 2 * ffn)
    sp = torch.tensor(SPECIAL)
    n = min(ffn, len(SPECIAL))
    h[0, :n] = sp[:n]  # as gates
    h[-1, ffn:ffn + n] = sp[:n]  # as ups
    h[-1, :n] = sp.flip(0)[:n]
    h = h.to(dtype)
    with torch.no_grad():
        got = module_ops.swiglu(h)
        want = F.silu(h[:, :ffn]) * h[:, ffn:]
    assert got.dtype == dtype and got.shape == (rows, ffn)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])  # the same infinities
    if dtype == torch.bfloat16:
        assert torch.equal(got[finite], want[finite])
    else:
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-37)
