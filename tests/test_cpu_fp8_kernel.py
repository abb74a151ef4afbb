"""The FP8 weight-only CPU Linear kernel (engines/cpu/panel_kernel.py fp8_*, csrc/fp8_panel_kernel.cpp): every
variant, forced, equals dequantize-then-matmul; a variant the CPU lacks is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from engines.cpu import panel_kernel as pk

pytestmark = pytest.mark.skipif(pk.load_fp8()[0] is None, reason="the C++ kernels cannot be built here")


def _runs_here(variant: str, dtype: torch.dtype = torch.float32) -> bool:
    try:
        return pk.fp8_variant(variant, dtype) == variant
    except ValueError:
        return False


VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(not _runs_here(v), reason=f"this CPU lacks the {v} variant's "
                                                     "instructions (it is tested where they exist)"))
            for v in ("portable", "avx2", "avx512", "avx512_on_avx2")]
"""avx512_on_avx2: the avx512 variant's source (GCC vector code) built for AVX2, so its body is checked on any
AVX2 host; the avx512 build itself runs where the CPU has AVX-512."""


def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight (every byte pattern but NaN among them: subnormals, zeros, +-448) and per-output scales."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    raw = w.view(torch.uint8)
    span = min(k, 126)  # 0x00 .. 0x7d: zero, subnormals, normals up to 448; then their negatives
    raw[0, :span] = torch.arange(span, dtype=torch.uint8)
    raw[1, :span] = torch.arange(126 - span, 126, dtype=torch.uint8) | 0x80
    return w, torch.rand(n, generator=g) * 0.01 + 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("rows", "n", "k", "dtype", "bias"), [
    (1, 40, 131, torch.float32, False), (5, 33, 64, torch.float32, True), (11, 16, 200, torch.float32, False),
    (3, 50, 96, torch.bfloat16, True)])
def test_fp8_kernel_equals_dequantize_then_matmul(variant, rows, n, k, dtype, bias):
    w, scales = _fp8_weight(n, k, seed=rows)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k).to(dtype)
    panels = pk.fp8_pack_panels(w)
    assert panels.dtype == torch.uint8 and panels.numel() == -(-n // 16) * 16 * -(-k // 2) * 2  # one byte a weight
    assert torch.equal(pk.fp8_unpack_panels(panels, n, k).view(torch.uint8), w.view(torch.uint8))
    got = pk.fp8_linear(x, panels, scales, n, b, variant=variant)
    ref = x.float() @ (w.float() * scales[:, None]).t() + (b if bias else 0)  # dequantize, then matmul
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}  # bf16: one rounding
    torch.testing.assert_close(got, ref.to(dtype), **tol)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16 * 9 + 5, 72), (1, 16 * 9 + 5, 70), (7, 40, 72),
                                              (23, 40, 72), (24, 40, 72), (47, 16 * 3 + 5, 601)])
def test_vector_variants_give_the_portable_bits(variant, rows, n, k):
    """Every variant sums each output in the same order with one fused multiply-add an input: the same bits
    as the portable scalar reference (one row: several panels a pass, two input pairs a step and, at 70 inputs,
    the odd pair after them; a tail panel alone; a row block; from 24 rows on AVX2, each slice of a panel decoded
    once for blocks of up to 6 rows: 47 rows in 8 blocks, 601 inputs in 3 slices, the last one short and odd)."""
    w, scales = _fp8_weight(n, k, seed=n)
    panels = pk.fp8_pack_panels(w)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k).to(dtype)
        b = torch.randn(n)
        assert torch.equal(pk.fp8_linear(x, panels, scales, n, b, variant=variant),
                           pk.fp8_linear(x, panels, scales, n, b, variant="portable"))


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_blocks_of_passes_give_the_portable_bits(variant, threads):
    """One row over 46 panels on 1-3 threads: each thread's share in blocks of 2-4 passes whose streams run through
    consecutive panels (AVX2, csrc/fp8_range.cpp), then whole passes and single panels: the portable bits, every
    output where the reference puts it."""
    n, k = 16 * 45 + 5, 70
    w, scales = _fp8_weight(n, k, seed=3)
    panels = pk.fp8_pack_panels(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, k).to(dtype)
            assert torch.equal(pk.fp8_linear(x, panels, scales, n, None, variant=variant),
                               pk.fp8_linear(x, panels, scales, n, None, variant="portable"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_rows_claimed_by_the_threads_equal_dequantize_then_matmul(variant, threads):
    """Several rows: the threads claim panels from a shared counter in claims that shrink toward the end (on AVX2's
    blocked rows, panels of one chunk of rows at a time: 301 rows of 601 inputs are 3 chunks; csrc/fp8_range.cpp
    run_fp8, panel_src::claimed_for): on 1-3 threads every output is written, dequantize-then-matmul's value, and the
    bits do not depend on the thread count."""
    n, k = 16 * 7 + 5, 601
    w, scales = _fp8_weight(n, k, seed=7)
    panels, b = pk.fp8_pack_panels(w), torch.randn(n)
    xs = [torch.randn(rows, k) for rows in (30, 301)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [pk.fp8_linear(x, panels, scales, n, b, variant=variant) for x in xs]
        torch.set_num_threads(threads)
        for x, one in zip(xs, alone):
            got = pk.fp8_linear(x, panels, scales, n, b, variant=variant)
            torch.testing.assert_close(got, x @ (w.float() * scales[:, None]).t() + b, atol=1e-4, rtol=1e-5)
            assert torch.equal(got, one)
    finally:
        torch.set_num_threads(before)


BF16_VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(not _runs_here(v, torch.bfloat16), reason=f"this CPU "
                                                          f"lacks the {v} variant's instructions (tested where they exist)"))
                 for v in ("avx512bf16", "avx512bf16_emulated")]
"""The bf16-row variants: vdpbf16ps (AVX512-BF16) and its arithmetic in scalar C++ (any host)."""


def _subnormals_as_zero(w: torch.Tensor) -> torch.Tensor:
    raw = w.view(torch.uint8)
    return torch.where((raw & 0x78) == 0, raw & 0x80, raw).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("variant", BF16_VARIANTS)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16 * 9 + 5, 72), (7, 40, 72), (3, 50, 131)])
def test_bf16_variants_give_the_portable_bits_with_subnormal_weights_as_zero(variant, rows, n, k):
    """vdpbf16ps adds a pair's input 2k product, then input 2k + 1's, each rounded once: the portable order and
    bits, except that it flushes denormal inputs: an e4m3 subnormal weight counts as zero. Also within bf16's
    rounding of dequantize-then-matmul, and refused for float32 rows by name."""
    w, scales = _fp8_weight(n, k, seed=n)
    assert ((w.view(torch.uint8) & 0x78) == 0).any()  # subnormals (and zeros) among the weights
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)
    got = pk.fp8_linear(x, pk.fp8_pack_panels(w), scales, n, b, variant=variant)
    flushed = _subnormals_as_zero(w)
    assert torch.equal(got, pk.fp8_linear(x, pk.fp8_pack_panels(flushed), scales, n, b, variant="portable"))
    one = torch.tensor([[0x01, 0x00]], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2^-9 (subnormal), 0
    panels, ones = pk.fp8_pack_panels(one), torch.ones(1, 2, dtype=torch.bfloat16)
    assert pk.fp8_linear(ones, panels, torch.ones(1), 1, variant="portable").item() == 2 ** -9
    assert pk.fp8_linear(ones, panels, torch.ones(1), 1, variant=variant).item() == 0.0  # flushed
    ref = x.float() @ (w.float() * scales[:, None]).t() + b
    torch.testing.assert_close(got, ref.to(torch.bfloat16), atol=2e-2, rtol=8e-3)
    with pytest.raises(ValueError, match="bfloat16 rows"):
        pk.fp8_linear(x.float(), pk.fp8_pack_panels(w), scales, n, b, variant=variant)


@pytest.mark.skipif(not _runs_here("avx512bf16", torch.bfloat16), reason="this CPU lacks AVX512-BF16 (the emulation "
                    "is checked against the portable bits on every host)")
def test_the_emulation_equals_the_avx512bf16_variant_bit_for_bit():
    """Subnormal weights included: the scalar emulation flushes what the instruction flushes."""
    for rows, n in ((1, 16 * 5 + 3), (1, 16 * 37 + 3), (6, 33)):  # one row: 6, or 16 + 16 + 6 panels a pass
        w, scales = _fp8_weight(n, 96, seed=rows)
        x, panels = torch.randn(rows, 96).to(torch.bfloat16), pk.fp8_pack_panels(w)
        assert torch.equal(pk.fp8_linear(x, panels, scales, n, variant="avx512bf16"),
                           pk.fp8_linear(x, panels, scales, n, variant="avx512bf16_emulated"))


def test_the_decoding_is_exact_for_every_byte():
    """All 254 non-NaN e4m3 bytes through a one-input Linear of scale 1: the kernel reads torch's values."""
    w = torch.arange(256, dtype=torch.uint8)
    w = w[(w & 0x7F) != 0x7F].view(torch.float8_e4m3fn)[:, None]  # (254, 1)
    got = pk.fp8_linear(torch.ones(1, 1), pk.fp8_pack_panels(w), torch.ones(w.shape[0]), w.shape[0])
    assert torch.equal(got[0], w.float()[:, 0])


def test_variants_resolve_and_refuse_by_name():
    assert pk.fp8_variant("auto") in ("portable", "avx2", "avx512")
    assert pk.fp8_variant("auto", torch.bfloat16) == ("avx512bf16" if _runs_here("avx512bf16", torch.bfloat16)
                                                      else pk.fp8_variant("auto"))
    with pytest.raises(ValueError, match="bfloat16 rows"):
        pk.fp8_variant("avx512bf16_emulated")
    assert pk.fp8_variant("portable") == "portable"
    with pytest.raises(ValueError, match="allowed"):
        pk.fp8_variant("amx")
    if not _runs_here("avx512"):  # this AVX2 host: the AVX-512 variant is compiled, guarded, refused by name
        with pytest.raises(ValueError, match="AVX-512F"):
            pk.fp8_linear(torch.ones(1, 16), pk.fp8_pack_panels(torch.ones(16, 16).to(torch.float8_e4m3fn)),
                          torch.ones(16), 16, variant="avx512")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_layer_equals_the_dequantizing_layer(dtype):
    """Fp8PanelLinear (kept one byte a weight) against engines.transforms.fp8's Fp8Linear, whose forward dequantizes:
    decode rows through the kernel, a prefill chunk through F.linear on a per-call dequantized copy."""
    from engines.cpu.fast_linear import BULK_FROM
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.transforms.fp8 import Fp8Linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=True))
    model[0] = Fp8Linear.quantize(model[0])
    ref = model[0]
    model[0] = Fp8PanelLinear.from_fp8(ref, dtype)  # what engines.transforms.fp8.apply_fp8 does on CPU
    assert model[0].panels.element_size() == 1 and torch.equal(model[0].weight_fp8().view(torch.uint8),
                                                               ref.weight.view(torch.uint8))
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 1e-2}
    for rows in (1, 7, BULK_FROM):
        x = torch.randn(rows, 96).to(dtype)
        torch.testing.assert_close(model(x), ref(x).to(dtype), **tol)


def test_fp8_layer_compiles_whole_graph_through_its_operator():
    """A compiled decode step (compile_decode on: fullgraph) calls the kernel as an operator, not by tracing into its
    loader (which takes a lock: dynamo refused the whole step, bench_gpu.py --smoke on eedd858); same bits as eager."""
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.transforms.fp8 import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8PanelLinear.from_fp8(Fp8Linear.quantize(torch.nn.Linear(64, 48, bias=True)), torch.float32)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), layer(x))
