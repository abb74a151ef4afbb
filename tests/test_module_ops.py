"""The module path's C++ SwiGLU (engines/cpu/module_ops.py, csrc/fused_decode.cpp swiglu_rows: 16 lanes at a time
for bf16 and fp32, a scalar tail) against torch's silu(gate) * up, special values included: bf16 bit for bit; fp32
within the exponential's error (its 16-lane polynomial, ~2e-7 relative); its tanh GELU against the exact function;
and the Linears with the activation or the residual add in the panel kernel's store against the two steps."""

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


def _variants() -> list[str]:
    """The host's own panel variant and, where the CPU has it, the AVX2 one forced (its blocked rows)."""
    from engines.cpu import panel_kernel as pk

    variants = ["auto"]
    try:
        variants.append(pk.panel_variant("avx2"))
    except ValueError:
        pass
    return variants


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
    variants = _variants()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n"), [(1, 3072), (5, 37), (64, 272), (3, 7)])
def test_gelu_tanh_near_the_exact_function(dtype, rows, n):
    """module_ops.gelu_tanh (csrc/mlp_rows.cpp: x sigmoid(2u) from one exponential, 8 lanes at a time; a row's tail
    through the same lanes) against the tanh GELU in float64, as x sigmoid(2u) (float64's 0.5 x (1 + tanh(u)) is -0
    from x ~ -8, where the function is ~1e-22): fp32 within 2e-7 |x| (torch's own fp32 kernel: ~1e-7) + 1e-36 (its
    exponential below e^-87 counts as 0), bf16 within a bf16 step (2^-7 of the value: its rounding, plus ours near a
    tie); every special value as torch gives it (NaN, infinities, signed zeros, overflow of x^3); n not a multiple of
    8."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    h = torch.randn(rows, n, generator=g) * torch.logspace(-3, 1.3, n)
    sp = torch.tensor(SPECIAL + [1e20, -1e20, -5.0, -9.0])
    k = min(n, len(sp))
    h[0, :k] = sp[:k]
    h = h.to(dtype)
    with torch.no_grad():
        got = module_ops.gelu_tanh(h)
        torch_says = F.gelu(h, approximate="tanh")
        hd = h.double()  # x sigmoid(2u) = 0.5 x (1 + tanh(u)), without the cancellation of 1 + tanh(u) below x ~ -8
        exact = hd * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (hd + 0.044715 * hd ** 3))
    assert got.dtype == dtype and got.shape == h.shape
    assert torch.equal(got.isnan(), torch_says.isnan()) and torch.equal(got.isinf(), torch_says.isinf())
    special = ~torch_says.isfinite() | (h == 0) | (h.abs() > 1e15)
    assert torch.equal(got[special & ~got.isnan()], torch_says[special & ~got.isnan()])
    zero = special & (torch_says == 0)
    assert torch.equal(got[zero].signbit(), torch_says[zero].signbit())  # -0 where torch has -0
    fin = ~special
    if dtype == torch.float32:
        err = (got[fin].double() - exact[fin]).abs()
        assert (err <= 2e-7 * h[fin].double().abs() + 1e-36).all(), err.max()
    else:
        step = exact[fin].abs() * 2 ** -7  # a bf16 step at most: its own rounding plus ours near a tie
        assert ((got[fin].double() - exact[fin]).abs() <= step + 1e-36).all()
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    kept = h.clone()  # the input is not written (a forward hook may hold it); the same bits again
    assert torch.equal(module_ops.gelu_tanh(kept).view(iv), got.view(iv)) and torch.equal(kept.view(iv), h.view(iv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k", "n"), [(7, 72, 48), (80, 72, 40), (300, 601, 3072 // 16 + 5)])
def test_panel_gelu_gives_the_two_steps_bits(dtype, rows, k, n):
    """panel_gelu (an MLP's up Linear with the tanh GELU in its store: csrc/mlp_rows.cpp) equals
    gelu_tanh(panel_linear(x)) bit for bit, forced to the AVX2 blocks (blocked rows from 48; several chunks of row blocks,
    slices of an odd K, a last panel of 5 of 16 outputs at 300 x 601) and on the host's own variant, with a bias; through
    module_ops.linear_gelu for a FastLinear on the panel kernel, and the plain Linear's two steps for another."""
    from engines.cpu import panel_kernel as pk
    from engines.cpu.fast_linear import FastLinear, panel_available

    if not panel_available(dtype):
        pytest.skip(f"the {dtype} panel kernel is not available here")
    mod = kernels.load()[0]
    g = torch.Generator().manual_seed(rows + k)
    w, x = (torch.randn(n, k, generator=g) / 8).to(dtype), (torch.randn(rows, k, generator=g) * 2).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, -0.0])
    panels = pk.pack_panels(w)
    variants = _variants()
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for variant in variants:
        code = pk.PANEL_VARIANTS[variant]
        want = module_ops.gelu_tanh(mod.panel_linear(x, panels, n, b, code))
        got = mod.panel_gelu(x, panels, n, b, code)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert torch.equal(got.view(iv), want.view(iv)), variant
    lin = torch.nn.Linear(k, n).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(w), lin.bias.copy_(b)
        fast = FastLinear(lin, "panel", "panel", "panel")
        assert torch.equal(module_ops.linear_gelu(fast, x).view(iv), module_ops.gelu_tanh(fast(x)).view(iv))
        assert torch.equal(module_ops.linear_gelu(lin, x).view(iv), module_ops.gelu_tanh(lin(x)).view(iv))
    with pytest.raises(RuntimeError, match="panels of N"):
        mod.panel_gelu(x, panels, n + 16, b, 0)
