"""The panel Linear kernel (engines/cpu/panel_kernel.py): what nn.Linear computes, the same bits on any
thread count and for a row alone or in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.core.hardware import read_cpu_flags
from engines.cpu import panel_kernel as pk

pytestmark = pytest.mark.skipif(pk.load()[0] is None, reason="no C++ compiler to build the panel kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inputs", [96, 97])
def test_matches_linear(dtype, rows, bias, inputs):
    """Outputs not a multiple of 16 (a padded last panel), rows beyond one block of 16, an odd input
    count (bf16 pairs inputs: the last pair is padded)."""
    torch.manual_seed(0)
    w = (torch.randn(83, inputs) * 0.1).to(dtype)
    b = torch.randn(83).to(dtype) if bias else None
    x = torch.randn(rows, inputs).to(dtype)
    got = pk.panel_linear(x, pk.pack_panels(w), 83, b)
    assert got.dtype == dtype and got.shape == (rows, 83)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # fp32 sums, as the kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def _row_variant_runs(variant: str) -> bool:
    try:
        return pk.panel_variant(variant) == variant
    except ValueError:
        return False


AVX2 = pytest.param("avx2", marks=pytest.mark.skipif(
    not _row_variant_runs("avx2"), reason="this CPU lacks AVX2 + FMA (the variant is tested where they exist)"))
DPBF16 = "avx512_bf16" in (read_cpu_flags() or ())
"""Whether the portable code's bf16 sums are vdpbf16ps (the kernels build with -march=native): it adds a pair's high
product before its low one (and flushes denormals), so the AVX2 variant's bf16 sums (the low product first) match
them within rounding on such a host, bit for bit elsewhere (a Zen 4 EPYC: 1,537 inputs changed a bf16 output)."""


def _portable_match(got: torch.Tensor, ref: torch.Tensor, bf16: bool, what, res: torch.Tensor | None = None) -> None:
    """The AVX2 variant against the portable code: the same bits, or on a vdpbf16ps host (DPBF16) for bf16 weights
    the same sums in another order: fp32 sums within a few ulps; bf16 outputs equal but for rare rounding flips, each
    within a bf16 ulp of the Linear's output (plus the residual `res` added after its rounding)."""
    if not (bf16 and DPBF16):
        assert torch.equal(got, ref), what
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"{what}: {m}")
    else:
        diff, r = (got.float() - ref.float()).abs(), ref.float()
        bound = 2 ** -7 * (r.abs() if res is None else (r - res.float()).abs() + res.float().abs()) + 1e-3
        assert (diff <= bound).all() and (diff > 0).float().mean() < 0.01, (what, diff.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["portable", "amx_emulated", AVX2])
def test_same_bits_on_any_thread_count_and_batch(dtype, variant):
    """Each output is summed in one order by one thread: 1 or 2 threads, and a row in a batch of 34 (row blocks
    of 12, 11 and 11) or of 2, equal bits (so the adaptive thread count and the batch's company never change a token). The portable code
    also gives a row alone its batch bits; AMX's tiles sum a row alone (the one-row code) otherwise."""
    torch.manual_seed(1)
    n = 300  # 19 panels: a row alone runs passes of 8, 8 and 3 on one thread, 8, 2 and 8, 1 on two
    w = torch.randn(n, 320).to(dtype)
    x = torch.randn(34, 320).to(dtype)
    panels = pk.pack_panels(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pk.panel_linear(x, panels, n, None, variant=variant)
        alone = [pk.panel_linear(x[i:i + 1], panels, n, None, variant=variant) for i in range(3)]
        torch.set_num_threads(2)
        two = pk.panel_linear(x, panels, n, None, variant=variant)
        assert all(torch.equal(pk.panel_linear(x[i:i + 1], panels, n, None, variant=variant), alone[i]) for i in range(3))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for i in (0, 7, 16, 33):
        pair = pk.panel_linear(x[[i, (i + 5) % 34]], panels, n, None, variant=variant)
        assert torch.equal(pair[:1], one[i:i + 1])
        if variant != "amx_emulated" or dtype == torch.float32:
            assert torch.equal(pk.panel_linear(x[i:i + 1], panels, n, None, variant=variant), one[i:i + 1])


def test_dtype_mismatch_is_an_error():
    panels = pk.pack_panels(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="share a dtype"):
        pk.panel_linear(torch.randn(1, 8).to(torch.bfloat16), panels, 16, None)


def test_huge_page_copy_is_an_equal_aligned_copy():
    """The panel copies of the weights live in 2 MB-aligned memory (Linux), with the same values; a
    tensor under 2 MB is kept as it is."""
    import sys

    from engines.cpu.host_memory import HUGE_PAGE, huge_page_copy

    small = torch.randn(10, 10)
    assert huge_page_copy(small) is small
    big = torch.randn(1024, 1024)  # 4 MB
    copy = huge_page_copy(big)
    assert torch.equal(copy, big) and copy.is_contiguous()
    if sys.platform.startswith("linux"):
        assert copy.data_ptr() != big.data_ptr() and copy.data_ptr() % HUGE_PAGE == 0
    del big
    assert torch.isfinite(copy.sum())  # the copy owns its memory


def test_huge_page_zeros_are_untouched_aligned_zeros():
    """The CPU KV cache's memory: 2 MB-aligned zeros (Linux), mapped on first write; None under 2 MB; the cache
    falls back to numpy zeros where none is given."""
    import sys

    from engines.cpu.host_memory import HUGE_PAGE, huge_page_zeros
    from engines.model.attention import KVCache

    assert huge_page_zeros(HUGE_PAGE - 1) is None
    z = huge_page_zeros(3 * HUGE_PAGE)
    if not sys.platform.startswith("linux"):
        assert z is None
        return
    assert z is not None and z.dtype == torch.uint8 and z.numel() == 3 * HUGE_PAGE and z.data_ptr() % HUGE_PAGE == 0
    assert int(z[::4096].sum()) == 0 and int(z[-1]) == 0
    z[5] = 7
    assert int(z.sum()) == 7
    cache = KVCache(2, 600, 16, 4, 64, torch.bfloat16)  # 2 x 2 x 9,600 slots x 256 values: 19.7 MB
    assert cache.data.data_ptr() % HUGE_PAGE == 0 and cache.data.shape == (2, 2, 9600, 4, 64)
    assert not cache.data[1, 1, -1].any()


def test_a_stale_build_lock_does_not_hang_the_load(tmp_path, monkeypatch):
    """A lock left by a process killed mid-build (older than STALE_LOCK_S) is removed before loading;
    a fresh one (another process building now) is left alone. On a copy of the built module's directory
    (a lock in the shared one would send the other test workers' loads through torch's builder beside
    this one's)."""
    import os
    import shutil
    import time

    from torch.utils.cpp_extension import _get_build_directory

    from engines.cpu import kernels
    from engines.cpu.cpp_ext import STALE_LOCK_S, build_name, clear_stale_lock

    name = build_name("shardserve_cpu_", kernels.combined_source())
    assert kernels.load()[0] is not None  # built in the shared directory (make setup's prebuild)
    shutil.copytree(_get_build_directory(name, verbose=False), tmp_path / name, symlinks=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    assert lock.startswith(str(tmp_path))
    open(lock, "w").close()
    try:
        assert clear_stale_lock(name) is False and os.path.exists(lock)  # fresh: someone is building
        old = time.time() - STALE_LOCK_S - 60
        os.utime(lock, (old, old))
        mod, why = kernels.load.__wrapped__()  # the module's build, past its cache
        assert mod is not None, why
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)


def test_kernel_calls_release_the_gil():
    """A kernel call runs without the GIL (engines/cpp_ext.bindings), as torch's ops do: the serving
    process's event loop keeps running during an engine step that is one long kernel call. While
    another thread is inside one call of ~0.1-1 s, this thread's Python loop runs many times; holding
    the GIL, the call would let it run only before and after (no time bound is asserted: only that
    Python ran during the call's middle half)."""
    import threading
    import time

    torch.manual_seed(2)
    w = torch.randn(4096, 4096)
    x = torch.randn(1024, 4096)  # ~34 GFLOP: far longer than the interpreter's 5 ms switch interval
    panels = pk.pack_panels(w)
    span: list[float] = []

    def call() -> None:
        with torch.inference_mode():
            span.append(time.perf_counter())
            pk.panel_linear(x, panels, 4096, None)
            span.append(time.perf_counter())

    ticks: list[float] = []
    th = threading.Thread(target=call)
    th.start()
    while th.is_alive():
        ticks.append(time.perf_counter())
    th.join()
    t0, t1 = span
    quarter = (t1 - t0) / 4
    inside = [t for t in ticks if t0 + quarter < t < t1 - quarter]
    assert len(inside) > 10, f"{len(inside)} Python iterations in the middle half of a {t1 - t0:.3f} s kernel call"


@pytest.mark.parametrize("variant", [AVX2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_variants_give_the_portable_bits(variant, dtype):
    """The one-row kernel forced to each variant: the portable code's bits (same FMAs, same order), on 4-panel
    passes and a tail (9 panels), with a bias; and still a row of a batch's bits."""
    torch.manual_seed(2)
    w = torch.randn(16 * 9 - 3, 130).to(dtype)
    b = torch.randn(w.shape[0]).to(dtype)
    x = torch.randn(3, 130).to(dtype)
    panels = pk.pack_panels(w)
    got = pk.panel_linear(x[:1], panels, w.shape[0], b, variant=variant)
    assert torch.equal(got, pk.panel_linear(x[:1], panels, w.shape[0], b, variant="portable"))
    assert torch.equal(got, pk.panel_linear(x, panels, w.shape[0], b)[:1])


@pytest.mark.parametrize("variant", [AVX2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [130, 131])
def test_several_row_variants_give_the_portable_bits(variant, dtype, inputs):
    """Several rows forced to each variant (AVX2: fp32 blocks of 6 rows read as the rows are, bf16 blocks of 4 rows
    widened to fp32 pairs first): the portable code's bits for every row count from 2 to 40 (one block and its remainders, near-equal
    blocks), with a bias and a padded last panel, an odd input count (bf16: a padded pair); and the fp32 sums of
    panel_linear_f32 likewise."""
    torch.manual_seed(4)
    n = 16 * 9 - 3
    w = torch.randn(n, inputs).to(dtype)
    b = torch.randn(n).to(dtype)
    panels = pk.pack_panels(w)
    for rows in [*range(2, 14), 17, 23, 34, 40]:
        x = torch.randn(rows, inputs).to(dtype)
        bf16 = dtype == torch.bfloat16
        got = pk.panel_linear(x, panels, n, b, variant=variant)
        _portable_match(got, pk.panel_linear(x, panels, n, b, variant="portable"), bf16, rows)
        if bf16:
            got32 = pk.panel_linear_f32(x, panels, n, variant=variant)
            _portable_match(got32, pk.panel_linear_f32(x, panels, n, variant="portable"), bf16, rows)


@pytest.mark.parametrize("variant", [AVX2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [600, 1537])
def test_many_rows_blocked_give_the_portable_bits(variant, dtype, inputs):
    """Prefill chunks and decode batches on AVX2 (bf16 from 16 rows, fp32 from 2: the test above too): the rows in
    blocks of 6, chunks of blocks through each panel a slice at a time (fp32 256 inputs; bf16 128 pairs widened to
    fp32 once a slice), the sums carried between slices. The portable code's bits for near-equal blocks and their
    remainders, several chunks (1,537 inputs: 5 blocks a chunk), 2-7 slices, an odd input count (bf16: a padded
    pair), a bias, a residual, a padded last panel, on 1-3 threads (which claim a chunk's panels from a shared
    counter: run_blocked); and panel_linear_f32's sums."""
    torch.manual_seed(5)
    n = 16 * 5 - 3
    w = torch.randn(n, inputs).to(dtype)
    b = torch.randn(n).to(dtype)
    panels = pk.pack_panels(w)
    mod, before = pk.load()[0], torch.get_num_threads()
    try:
        for threads, rows in ((1, 16), (1, 48), (1, 97), (2, 49), (2, 301), (3, 301)):
            torch.set_num_threads(threads)
            x = torch.randn(rows, inputs).to(dtype)
            res = torch.randn(rows, n).to(dtype)
            bf16 = dtype == torch.bfloat16
            got = pk.panel_linear(x, panels, n, b, variant=variant)
            _portable_match(got, pk.panel_linear(x, panels, n, b, variant="portable"), bf16, (rows, threads))
            got = mod.panel_linear_res(x, panels, n, b, res, pk.PANEL_VARIANTS[variant])
            _portable_match(got, mod.panel_linear_res(x, panels, n, b, res, pk.PANEL_VARIANTS["portable"]), bf16, rows,
                            res)
            if bf16:
                got32 = pk.panel_linear_f32(x, panels, n, variant=variant)
                _portable_match(got32, pk.panel_linear_f32(x, panels, n, variant="portable"), bf16, (rows, threads))
    finally:
        torch.set_num_threads(before)


def test_panel_variants_resolve_and_refuse_by_name():
    assert pk.panel_variant("auto") in ("portable", "avx2", "amx")
    assert pk.panel_variant("portable") == "portable"
    assert pk.panel_variant("amx_emulated") == "amx_emulated"
    with pytest.raises(ValueError, match="allowed"):
        pk.panel_variant("avx512")
    if not _row_variant_runs("amx"):
        with pytest.raises(ValueError, match="amx variant needs AMX"):
            pk.panel_variant("amx")

AMX_VARIANTS = ["amx_emulated", pytest.param("amx", marks=pytest.mark.skipif(
    not _row_variant_runs("amx"), reason="this host has no AMX-TILE + AMX-BF16 (the emulated variant checks the layout)"))]


@pytest.mark.parametrize("variant", AMX_VARIANTS)
@pytest.mark.parametrize("rows", [2, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("shape", [(83, 64), (160, 96), (48, 40)])
def test_amx_rows_match_linear(variant, rows, shape):
    """bf16 rows as 16-row tiles: every row count (a padded last tile, one or two tiles a pass), outputs not a
    multiple of 16, odd and even panel counts a thread; K = 40 (not a multiple of 32) takes the vector code. Within
    the output's rounding of fp32 sums, as the portable code; the emulated sums are the portable code's (the same
    products, in the same order) up to rounding, and AMX's agree with both to a bf16 ulp."""
    n, k = shape
    torch.manual_seed(rows)
    w = (torch.randn(n, k) * 0.1).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    panels = pk.pack_panels(w)
    got = pk.panel_linear(x, panels, n, b, variant=variant)
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    port = pk.panel_linear(x, panels, n, b, variant="portable")
    torch.testing.assert_close(got.float(), port.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("variant", ["portable", AVX2, *AMX_VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stores_round_as_torch(variant, dtype):
    """The store loop (a full panel's 16 outputs a vector): small integers make every sum exact, so the output
    must be torch's own rounding of sum + bias, bit for bit; an infinite input times a zero weight makes NaN
    rows (torch's NaN), infinite sums keep their sign."""
    torch.manual_seed(3)
    w = torch.randint(-3, 4, (48, 64)).to(dtype)
    b = (torch.randint(-50, 50, (48,)) * 0.37).to(dtype)
    x = torch.randint(-9, 10, (5, 64)).to(dtype) * 37.0
    x[1, 0] = float("inf")
    w[5, 0] = 0
    x[2, 3] = float("-inf")
    x = x.to(dtype)
    got = pk.panel_linear(x, pk.pack_panels(w), 48, b, variant=variant)
    ref = (F.linear(x.double(), w.double()) + b.double()).to(dtype)
    assert torch.equal(got.isnan(), ref.isnan()) and got[1, 5].isnan()
    ok = ~ref.isnan()
    assert torch.equal(got[ok], ref[ok])
