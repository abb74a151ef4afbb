"""The CPU kernel choices of engines/cpu/fast_linear.py compute exactly what nn.Linear computes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import engines.cpu.fast_linear as fl
from engines.cpu.fast_linear import FastLinear, apply_fast_linear, packing_available

ONE_ROW_ONLY = {"gemv"}


@pytest.fixture(autouse=True)
def _private_choices(monkeypatch, tmp_path):
    """Each test times (or loads) its own choices: nothing shared with the user's cache or another test; the host
    reads as quiet (a busy CI host would otherwise leave choices unsaved; the busy case has its own test)."""
    from engines.cpu import cpu_threads

    monkeypatch.setenv("SHARDSERVE_FAST_LINEAR_CACHE", str(tmp_path / "fast_linear.json"))
    monkeypatch.setattr(fl, "_CHOSEN", {})
    monkeypatch.setattr(cpu_threads, "fork_join_s", lambda: 0.0)


def _avx2_runs() -> bool:
    """Whether the panel kernel's avx2 variant runs here (AVX2 + FMA and the kernel built)."""
    from engines.cpu import panel_kernel

    if not fl.panel_available(torch.float32):
        return False
    try:
        return panel_kernel.panel_variant("avx2") == "avx2"
    except ValueError:
        return False


AVX2 = _avx2_runs()


def _kernels(dtype):
    return [k for k in sorted(set(fl.ONE_ROW + fl.MULTI_ROW)) if (k not in ("packed", "halves")
            or packing_available(dtype)) and (k != "panel" or fl.panel_available(dtype)) and (k != "panel_avx2" or AVX2)]


@pytest.mark.parametrize("kernel", _kernels(torch.float32))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 7, 48), (3, 5, 48), (70, 48)])
def test_kernels_match_linear(kernel, bias, shape):
    """Every kernel, as the one-row, decode-batch and prefill kernel at once (the sliced one with
    a last slice shorter than the others), gives what nn.Linear gives."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    rows = x.numel() // 48
    if kernel in ONE_ROW_ONLY and rows != 1:
        fast = FastLinear(lin, one=kernel)  # multi-row kernels stay linear
    else:
        fast = FastLinear(lin, kernel, kernel, kernel, chunk=24)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="oneDNN bf16 not supported on this CPU")
@pytest.mark.parametrize("rows", [1, 4, 70])
def test_packed_bf16_matches_linear(rows):
    """The prepacked oneDNN kernel in bf16 (the batch-1 head's kernel on AVX512-BF16 / AMX CPUs)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    fast = FastLinear(lin, "packed", "packed", "packed")
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), lin(x).float(), rtol=2e-2, atol=2e-2)


def test_unknown_kernel_names_the_allowed_ones():
    fast = FastLinear(nn.Linear(8, 8), one="simd")
    with pytest.raises(ValueError, match="unknown kernel 'simd'.*packed"):
        fast(torch.randn(1, 8))


def test_apply_keeps_tied_head_and_outputs(gpt2_dir):
    from engines.loading.checkpoint import load_model

    model, cfg = load_model(gpt2_dir)
    keys = set(model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        before = model.logits(model(idx))
        choices = apply_fast_linear(model)
        after = model.logits(model(idx))
        one = model.logits(model(idx[:, :1]))
    assert all(set(c) <= set(fl.ONE_ROW + fl.MULTI_ROW) for c in choices.values())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one[0, 0], before[0, 0], rtol=1e-5, atol=1e-5)
    assert model.lm_head.weight is model.wte.weight
    assert set(model.state_dict()) == keys  # the extra layouts are not persistent


def test_wide_head_forced_sliced_keeps_the_tie_and_outputs(monkeypatch, gpt2_dir):
    """A head whose decode-batch choice is the sliced kernel keeps its tie and the model's logits."""
    from engines.loading.checkpoint import load_model

    model, cfg = load_model(gpt2_dir)
    monkeypatch.setattr(fl, "choose_kernels", lambda w, b: ("linear", "sliced", "linear", "linear"))
    idx = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        before = model.logits(model(idx))
        fl.apply_fast_linear(model)
        after = model.logits(model(idx))
    assert isinstance(model.lm_head, FastLinear) and model.lm_head.many == "sliced"
    assert model.lm_head.weight is model.wte.weight
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_choices_persist_per_machine_and_are_reused(monkeypatch, tmp_path):
    """A second process (the in-process memo cleared) reads the first one's choices instead of
    timing; another machine key times again."""
    w = torch.randn(40, 24)
    first = fl.choose_kernels(w, None)
    saved = json.loads((tmp_path / "fast_linear.json").read_text())
    entry = saved[fl.machine_key()]["40x24 float32"]
    assert tuple(entry["kernels"]) == first and len(entry["ms"]) == 4

    def no_timing(*a, **k):
        raise AssertionError("timed although a saved choice exists")

    monkeypatch.setattr(fl, "_CHOSEN", {})
    monkeypatch.setattr(fl, "_fastest", no_timing)
    assert fl.choose_kernels(w, None) == first
    monkeypatch.setattr(fl, "_CHOSEN", {})
    monkeypatch.setattr(fl, "machine_key", lambda: "another CPU")
    with pytest.raises(AssertionError, match="timed although"):
        fl.choose_kernels(w, None)


def test_unreadable_choices_file_is_timed_again(tmp_path):
    (tmp_path / "fast_linear.json").write_text("{not json")
    choice = fl.choose_kernels(torch.randn(16, 8), torch.randn(16))
    assert json.loads((tmp_path / "fast_linear.json").read_text())[fl.machine_key()]["16x8 float32 bias"][
        "kernels"] == list(choice)


def test_one_thread_steps_use_the_kernels_timed_on_one_thread(monkeypatch):
    """FastLinear dispatches on the step's thread count: `single` at one thread, the others above."""
    from engines.cpu.cpu_threads import intra_op_threads

    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    fast = FastLinear(lin, "linear", "linear", "linear", single=("pretransposed",) * 4)
    ran = []
    real = FastLinear.run

    def spy(self, kind, x2):
        ran.append(kind)
        return real(self, kind, x2)

    monkeypatch.setattr(FastLinear, "run", spy)
    x = torch.randn(3, 16)
    with torch.no_grad(), intra_op_threads(2):
        a = fast(x)
    with torch.no_grad(), intra_op_threads(1):
        b = fast(x)
    assert ran == ["linear", "pretransposed"]
    torch.testing.assert_close(a, b)
    assert "one thread=pretransposed" in repr(fast)


def test_long_prefill_chunks_take_their_own_timed_kernel(monkeypatch):
    """Rows from LARGE_FROM on run `large` (a kernel's rank moves with the rows: BULK_ROWS rows misjudged a 2,048-token
    chunk), fewer run `bulk`, each the Linear's result; choose_kernels times LARGE_ROWS rows for a block Linear and
    gives a vocabulary head its `bulk` choice untimed there."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    fast = FastLinear(lin, "linear", "linear", "linear", large="pretransposed")
    assert FastLinear(lin, "linear", "linear", "packed").large == "packed"  # not given: bulk's
    ran = []
    real = FastLinear.run
    monkeypatch.setattr(FastLinear, "run", lambda self, kind, x2: ran.append(kind) or real(self, kind, x2))
    with torch.no_grad():
        for rows in (fl.LARGE_FROM - 1, fl.LARGE_FROM):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(fast(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert ran == ["linear", "pretransposed"] and "large=pretransposed" in repr(fast)
    timed = []
    monkeypatch.setattr(fl, "_fastest", lambda fns, budget_s, min_rounds, **kw: timed.append(min_rounds) or (
        "linear", {k: 1.0 for k in fns}))
    assert fl.choose_kernels(torch.randn(40, 24), None, budget_s=0.0) == ("linear",) * 4 and len(timed) == 4
    timed.clear()
    monkeypatch.setattr(fl, "WIDE_MIN_OUT", 32)
    fl.choose_kernels(torch.randn(48, 24), None, budget_s=0.0)
    assert len(timed) == 3  # one row, a decode batch, a short chunk


def test_apply_times_one_thread_too_when_asked(monkeypatch, tmp_path, gpt2_dir):
    from engines.cpu.cpu_threads import intra_op_threads
    from engines.loading.checkpoint import load_model

    monkeypatch.setenv("SHARDSERVE_FAST_LINEAR_CACHE", str(tmp_path / "choices.json"))
    monkeypatch.setattr(fl, "_CHOSEN", {})
    seen = []
    monkeypatch.setattr(fl, "choose_kernels", lambda w, b: seen.append(torch.get_num_threads()) or
                        ("pretransposed", "linear", "linear", "linear"))
    model, _ = load_model(gpt2_dir, dtype=torch.float32)
    with intra_op_threads(2):
        apply_fast_linear(model, single_thread_too=True)
    assert seen and set(seen) == {1, 2} and seen.count(1) == seen.count(2)
    assert all(m.single == ("pretransposed", "linear", "linear", "linear") for m in model.modules() if isinstance(m, FastLinear))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_halves_on_two_threads_equal_the_whole_packed_weight(dtype, bias):
    """One row split by output features over two threads (odd width: unequal halves) gives exactly
    the whole prepacked kernel's row; more rows and one-thread steps run the whole weight."""
    from engines.cpu.cpu_threads import intra_op_threads

    if not packing_available(dtype):
        pytest.skip(f"oneDNN {dtype} packing not available here")
    torch.manual_seed(0)
    lin = nn.Linear(64, 81, bias=bias).to(dtype)
    fast = FastLinear(lin, "halves", "packed", "packed")
    whole = FastLinear(lin, "packed", "packed", "packed")
    with torch.no_grad(), intra_op_threads(2):
        for rows in (1, 3):
            x = torch.randn(rows, 64).to(dtype)
            assert torch.equal(fast(x), whole(x))
    with torch.no_grad(), intra_op_threads(1):
        x = torch.randn(1, 64).to(dtype)
        assert torch.equal(fast(x), whole(x))


@pytest.mark.skipif(not AVX2, reason="the panel kernel's avx2 variant does not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_panel_kind_is_offered_and_timed_only_where_auto_runs_other_code(monkeypatch, tmp_path, dtype):
    """"panel_avx2" (the avx2 code's row-major blocks on the same panels) is a candidate where auto resolves to other
    code (pinned to the portable code here: an AVX-512 host's case), timed for decode batches and prefill chunks, not
    one row; it computes the avx2 variant's bits; where auto is that code already it is not offered, and a saved
    choice naming it is timed again."""
    from engines.cpu import panel_kernel

    native = panel_kernel.panel_variant("auto") == "avx2"
    assert fl.panel_avx2_offered(dtype) == (not native)
    timed = []
    real = fl._fastest

    def spy(fns, *a, **k):
        timed.append(sorted(fns))
        return real(fns, *a, **k)

    monkeypatch.setattr(fl, "_fastest", spy)
    w = torch.randn(40, 24).to(dtype)
    with panel_kernel.auto_pinned("portable"):
        assert fl.panel_avx2_offered(dtype)
        fl.choose_kernels(w, None, budget_s=0.0)
        assert ["panel_avx2" in t for t in timed] == [False, True, True, True]
        lin = nn.Linear(24, 40, bias=True).to(dtype)
        fast = FastLinear(lin, "panel_avx2", "panel_avx2", "panel_avx2")
        for rows in (1, 2, 17, 70):
            x = torch.randn(rows, 24).to(dtype)
            with torch.no_grad():
                got = fast(x)
            assert torch.equal(got, panel_kernel.panel_linear(x, fast.panels, 40, lin.bias, "avx2")), rows
            torch.testing.assert_close(got.float(), lin(x).float(), rtol=2e-2, atol=2e-2)
    if native:  # a choice naming it, saved where it was offered, is timed again where it is not
        path = tmp_path / "fast_linear.json"
        data = json.loads(path.read_text())
        data[fl.machine_key()]["40x24 " + str(dtype).removeprefix("torch.")]["kernels"] = ["panel", "panel_avx2"] * 2
        path.write_text(json.dumps(data))
        monkeypatch.setattr(fl, "_CHOSEN", {})
        timed.clear()
        assert "panel_avx2" not in fl.choose_kernels(w, None, budget_s=0.0) and timed
    for bad in ("auto", "sse"):  # a pin names a variant other than auto
        with pytest.raises(ValueError, match="auto_pinned|allowed"), panel_kernel.auto_pinned(bad):
            pass
    assert fl.droppable(({"panel_avx2"}, {"linear"})) and fl.droppable(({"panel", "panel_avx2"}, {"panel_avx2"}))
    assert not fl.droppable(({"packed"}, {"panel_avx2"}))


@pytest.mark.skipif(not fl.panel_available(torch.float32), reason="the panel kernel cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_panels_only_linear_computes_the_same_and_keeps_one_copy(dtype):
    """dense=False: decode rows through the panels, prefill rows on the weight unpacked from them, bitwise
    the kernels of the layer that keeps its dense weight; the weight is gone, the panels are the one copy."""
    from engines.cpu import panel_kernel

    lin = nn.Linear(41, 37).to(dtype)  # no size a multiple of 16; bf16: an odd input padded to a pair
    keep = FastLinear(lin, one="panel", many="panel", bulk="linear")
    drop = FastLinear(lin, one="panel", many="panel", bulk="linear", dense=False)
    assert drop.weight is None and torch.equal(
        panel_kernel.unpack_panels(drop.panels, lin.out_features, lin.in_features), lin.weight.detach())
    with torch.no_grad():
        for rows in (1, 5, 70):
            x = torch.randn(rows, lin.in_features).to(dtype)
            assert torch.equal(drop(x), keep(x)), rows
    assert "dense weight dropped" in repr(drop)
    with pytest.raises(ValueError, match="dense=False"):
        FastLinear(lin, one="panel", many="linear", dense=False)  # a decode batch would read the dense weight


@pytest.mark.skipif(not fl.panel_available(torch.float32), reason="the panel kernel cannot be built here")
def test_apply_drops_dense_weights_but_never_a_tied_heads(monkeypatch, llama_dir):
    from engines.loading.checkpoint import load_model
    from engines.parallel.sharded_loading import shard_bytes

    model, cfg = load_model(llama_dir)
    tied, _ = load_model(llama_dir)
    idx = torch.randint(0, cfg.vocab_size, (1, 9))
    monkeypatch.setattr(fl, "choose_kernels", lambda w, b, budget_s=0.4: ("panel", "panel", "linear", "linear"))
    held = shard_bytes(model)
    with torch.no_grad():
        before = model.logits(model(idx))
        apply_fast_linear(model, drop_dense=True)
        after = model.logits(model(idx))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert all(b.mlp.up.weight is None and b.attn.qkv.weight is None for b in model.blocks)
    # a shard's weight count (the PP/TP memory tests) does not depend on which Linears the timings let drop
    assert shard_bytes(model) == held
    # bf16 prefill timed as "linear" beside the dense weight: with none left it runs oneDNN's packed copy (where
    # this build packs bf16), not a per-call unpacking of the panels; fp32 keeps unpacking
    if model.wte.weight.dtype == torch.bfloat16 and fl.packing_available(torch.bfloat16):
        assert all(b.mlp.up.bulk == "packed" and b.mlp.up.packed is not None for b in model.blocks)
    else:
        assert all(b.mlp.up.bulk == "linear" for b in model.blocks)
    if cfg.tie_word_embeddings:  # the head's weight is the embedding's: kept
        assert model.lm_head.weight is model.wte.weight
    tied.lm_head.weight = tied.wte.weight  # tie it here whatever the fixture's config
    apply_fast_linear(tied, drop_dense=True)
    assert tied.lm_head.weight is tied.wte.weight and tied.blocks[0].mlp.down.weight is None


@pytest.mark.skipif(not (fl.panel_available(torch.bfloat16) and fl.packing_available(torch.bfloat16)),
                    reason="the bf16 panel kernel or oneDNN's bf16 packing is not available here")
def test_a_bf16_linear_without_its_dense_weight_prefills_through_a_packed_copy(monkeypatch, llama_dir):
    """bf16, dense weight dropped: a prefill chunk timed as "linear" runs oneDNN's packed copy instead of unpacking
    the panels every call; the logits stay the module's within bf16 rounding."""
    from engines.loading.checkpoint import load_model

    model, cfg = load_model(llama_dir)
    model = model.to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (1, fl.BULK_FROM + 3))  # a prefill chunk
    monkeypatch.setattr(fl, "choose_kernels", lambda w, b, budget_s=0.4: ("panel", "panel", "linear", "linear"))
    with torch.no_grad():
        before = model.logits(model(idx))
        apply_fast_linear(model, drop_dense=True)
        after = model.logits(model(idx))
    up = model.blocks[0].mlp.up
    assert up.weight is None and up.bulk == "packed" and up.packed is not None
    torch.testing.assert_close(after, before, rtol=0.05, atol=0.05)


def test_a_timing_on_a_busy_host_is_taken_again_and_never_saved(monkeypatch, tmp_path):
    """Threads that wait a scheduler slice for each other make every kernel's time the scheduler's: a shape timed
    while the fork-join probe says so is timed again (TIMING_TRIES in all, once if that took over RETRY_MAX_S), used,
    and not saved; a quiet probe saves at the first try."""
    from engines.cpu import cpu_threads

    tries = []
    real = fl._fastest
    monkeypatch.setattr(fl, "_fastest", lambda *a, **k: tries.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu_threads, "fork_join_s", lambda: 1.0)  # 1 s a fork and join: busy
    w = torch.randn(24, 16)
    choice = fl.choose_kernels(w, None, budget_s=0.0)
    assert len(tries) == 4 * fl.TIMING_TRIES and set(choice) <= set(fl.ONE_ROW + fl.MULTI_ROW)
    assert not (tmp_path / "fast_linear.json").exists()
    monkeypatch.setattr(fl, "_CHOSEN", {})
    monkeypatch.setattr(fl, "RETRY_MAX_S", 0.0)  # a timing longer than this is not taken again
    tries.clear()
    fl.choose_kernels(w, None, budget_s=0.0)
    assert len(tries) == 4 and not (tmp_path / "fast_linear.json").exists()
    monkeypatch.setattr(fl, "_CHOSEN", {})
    monkeypatch.setattr(cpu_threads, "fork_join_s", lambda: 0.0)
    tries.clear()
    assert fl.choose_kernels(w, None, budget_s=0.0) and len(tries) == 4
    assert "24x16 float32" in json.loads((tmp_path / "fast_linear.json").read_text())[fl.machine_key()]


@pytest.mark.skipif(not fl.panel_available(torch.bfloat16), reason="the panel kernel does not build here")
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_forward_float_gives_the_unrounded_fp32_sums_of_bf16_rows(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=False).to(torch.bfloat16)
    fast = FastLinear(lin, "panel", "panel", "panel")
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.no_grad():
        out = fast.forward_float(x)
        rounded = fast(x).float()
    ref = x.double() @ lin.weight.double().t()  # the exact products of the bf16 inputs
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 sums: far inside bf16's step
    assert (out - rounded).abs().max() > 0  # not the bf16 output widened
    torch.testing.assert_close(out.to(torch.bfloat16).float(), rounded, rtol=0, atol=0.02)
    fp32 = FastLinear(nn.Linear(96, 8, bias=False), "panel", "panel", "panel")  # other dtypes: forward, widened
    xf = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(fp32.forward_float(xf), fp32(xf))


@pytest.mark.skipif(not fl.panel_available(torch.bfloat16), reason="the panel kernel does not build here")
def test_a_bf16_vocabulary_head_gets_fp32_logits_whatever_its_timings_chose(monkeypatch):
    """A bf16 head whose timings chose plain linear everywhere still becomes a FastLinear with panels, so its logits
    are the unrounded fp32 sums on every host (greedy near-ties are not decided by bf16 rounding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, fl.WIDE_MIN_OUT, bias=False)).to(torch.bfloat16)
    monkeypatch.setattr(fl, "choose_kernels", lambda w, b, budget_s=0.4: ("linear",) * 4)
    apply_fast_linear(model)
    head = model[0]
    assert isinstance(head, FastLinear) and head.panels is not None and head.one == "linear"
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = head.forward_float(x)
    ref = x.double() @ head.weight.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    narrow = nn.Sequential(nn.Linear(64, 32, bias=False)).to(torch.bfloat16)  # not a vocabulary head: left alone
    apply_fast_linear(narrow)
    assert type(narrow[0]) is nn.Linear


@pytest.mark.skipif(not fl.packing_available(torch.float32), reason="oneDNN packing is not available here")
def test_a_packed_copy_read_by_prefill_alone_is_laid_out_for_prefill_and_timed_so(monkeypatch):
    """"packed" read only by prefill chunks is reordered for BULK_ROWS rows (oneDNN's one-row fp32 layout is plain and
    repacked every call); read by a decode kernel too it keeps the one-row layout. Either gives F.linear's result,
    at any row count, and choose_kernels times a prefill chunk's "packed" on the prefill layout."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    bulk_only = FastLinear(lin, "linear", "linear", "packed")
    shared = FastLinear(lin, "linear", "packed", "packed")
    assert bulk_only.packed_rows == fl.BULK_ROWS and shared.packed_rows == 1
    with torch.no_grad():
        for rows in (1, 7, fl.BULK_FROM + 5, 300):
            x = torch.randn(rows, 96)
            ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
            for fast in (bulk_only, shared):
                torch.testing.assert_close(fast.run("packed", x), ref, rtol=1e-5, atol=1e-5)
    layouts = []
    real = fl.pack_weight
    monkeypatch.setattr(fl, "pack_weight", lambda w, rows=1: layouts.append(rows) or real(w, rows))
    fl.choose_kernels(torch.randn(48, 32), None, budget_s=0.0)
    assert fl.BULK_ROWS in layouts and 1 in layouts
