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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 80])
def test_linear_add_equals_the_torch_add(dtype, rows):
    """module_ops.linear_add (a block's projection plus the residual stream): through the panel kernel's store where
    the layer's kernel for the rows is the panel one (with a bias, 80 rows: the blocked rows on AVX2), the same bits
    as res + layer(x); a layer on another kernel, or a plain Linear, takes the torch add (the same bits too)."""
    from engines.cpu.fast_linear import FastLinear, panel_available

    if not panel_available(dtype):
        pytest.skip(f"the {dtype} panel kernel is not available here")
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(72, 40, bias=True).to(dtype)
    x, res = torch.randn(2, rows, 72, generator=g).to(dtype), torch.randn(2, rows, 40, generator=g).to(dtype)
    calls = []
    with torch.no_grad():
        for layer in (FastLinear(lin, "panel", "panel", "panel"), FastLinear(lin), lin):
            mod = kernels.load()[0]
            orig = mod.panel_linear_res
            mod.panel_linear_res = lambda *a, orig=orig, layer=layer: calls.append(layer) or orig(*a)
            try:
                got = module_ops.linear_add(layer, x, res)
            finally:
                mod.panel_linear_res = orig
            assert got.shape == res.shape and torch.equal(got, res + layer(x)), type(layer)
    assert len(calls) == 1 and calls[0].kind_for(2 * rows) == "panel"  # only the panel layer took the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k"), [(7, 72), (80, 72), (300, 601)])
def test_panel_swiglu_gives_the_two_steps_bits(dtype, rows, k):
    """panel_swiglu (a SwiGLU MLP's gate / up Linear with SwiGLU in its store: csrc/mlp_rows.cpp) equals
    swiglu(panel_linear(x)) bit for bit, forced to the AVX2 blocks (blocked rows from 48: several chunks of row blocks
    and slices of an odd K at 300 x 601) and on the host's own variant; 7 rows take the two steps; through
    module_ops.linear_swiglu for a FastLinear on the panel kernel, and the plain Linear's two steps for another."""
    from engines.cpu import panel_kernel as pk
    from engines.cpu.fast_linear import FastLinear, panel_available

    if not panel_available(dtype):
        pytest.skip(f"the {dtype} panel kernel is not available here")
    mod = kernels.load()[0]
    g = torch.Generator().manual_seed(rows + k)
    ffn = 48
    w, x = (torch.randn(2 * ffn, k, generator=g) / 8).to(dtype), (torch.randn(rows, k, generator=g) * 2).to(dtype)
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, -0.0])
    panels = pk.pack_panels(w)
    variants = ["auto"]
    try:
        variants.append(pk.panel_variant("avx2"))
    except ValueError:
        pass
    for variant in variants:
        code = pk.PANEL_VARIANTS[variant]
        want = mod.swiglu_rows_(mod.panel_linear(x, panels, 2 * ffn, None, code), ffn)
        got = mod.panel_swiglu(x, panels, ffn, code)
        assert got.dtype == dtype and got.shape == (rows, ffn)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), variant
    lin = torch.nn.Linear(k, 2 * ffn, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        fast = FastLinear(lin, "panel", "panel", "panel")
        assert torch.equal(module_ops.linear_swiglu(fast, x), module_ops.swiglu(fast(x)))
        assert torch.equal(module_ops.linear_swiglu(lin, x), module_ops.swiglu(lin(x)))
    with pytest.raises(RuntimeError, match="panels of 2 ffn"):
        mod.panel_swiglu(x, panels, ffn + 16, 0)
