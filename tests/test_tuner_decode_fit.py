"""Tuner: a one-shard layout's decode-step constants fitted on the engine's own decode batches in
one process and placed at the served steps' level (tuner.measure_engine.fit_on_engine), how the
cost model uses them (profiles.LAYOUT_DECODE), and that the profile and the closed loop's refit
carry them."""

from __future__ import annotations

import numpy as np
import pytest

from engines.core.config import ModelConfig
from tuner.cost import CostModel, StepWork
from tuner.measure_engine import DECODE_BATCHES, fit_on_engine
from tuner.profiles import LAYOUT_DECODE, HardwareProfile, ProfileError, load_profile, profile_from_dict
from tuner.refit import apply

MODELS = [ModelConfig(model_type="gpt2", vocab_size=v, n_layer=n, n_head=4, n_embd=c, max_position_embeddings=512)
          for n, c, v in ((2, 128, 2048), (6, 128, 2048), (2, 256, 8192), (8, 256, 512))]
# the engine in one process: a small cost per sequence (the fused decode step)
ENGINE = {"step_overhead_ms": 0.0, "layer_overhead_us": 60.0, "seq_layer_overhead_us": 2.0, "seq_overhead_us": 10.0,
          "matmul_scale": 1.0, "comm_scale": 1.0, "attention_prefill_tflops": 0.05, "attention_kv_gb_s": 3.0,
          "vocab_seq_ns": 0.0, "token_layer_width_ns": 0.5, "head_ns": 0.0}
# what the served fit gave the layout (prefill steps keep it): a big cost per sequence
SERVED = {**ENGINE, "seq_overhead_us": 700.0, "prefill_step_ms": 3.0}
SCALE, STEP_MS = 1.3, 0.4


def _profile(layouts: dict | None = None) -> HardwareProfile:
    return HardwareProfile(name="unit", memory_gib=1.0, hbm_bandwidth_gb_s=1.0, flops_tflops={"bfloat16": 1e-3},
                           intra_node_bandwidth_gb_s=1.0, inter_node_bandwidth_gb_s=1.0, collective_latency_us=0.0,
                           reserved_memory_gib=0.0, cores=2, layouts=layouts or {},
                           matmul_tflops={1: {"bfloat16": {1: 0.01, 64: 0.1}}, 2: {"bfloat16": {1: 0.02, 64: 0.2}}})


def _decode(b: int, ctx: int = 70) -> StepWork:
    return StepWork(tokens=b, sampled=b, decode_context=b * ctx, seqs=b)


def _rows():
    """(engine rows: decode batches of DECODE_BATCHES and their prefills; served rows: mostly batch 1,
    SCALE x the engine + STEP_MS, a few decode steps of 2-3 stretched 3-fold as the probes' bursts
    stretch them, and prefill steps at an unrelated time)."""
    base = _profile()
    eng_rows, served_rows = [], []
    for model in MODELS:
        truth = CostModel(model, base.replace(layouts={"1x1": ENGINE}))
        cost = CostModel(model, base)
        for b, plen, _ in DECODE_BATCHES:
            n = plen
            eng_rows.append((StepWork(tokens=b * n, sampled=b, prefill_attn_pairs=b * n * (n + 1) // 2, seqs=b),
                             0.5, cost))  # a prefill: not fitted, whatever its time
            for ctx in (65, 68, 71):
                eng_rows.append((_decode(b, ctx), truth.step_time(_decode(b, ctx)), cost))
        for i in range(30):
            b = 1 if i % 6 else 2 + i % 2
            t = SCALE * truth.step_time(_decode(b, 90 + i)) + STEP_MS * 1e-3
            served_rows.append((_decode(b, 90 + i), t * (3.0 if b > 1 and i % 4 == 0 else 1.0), cost))
        served_rows.append((StepWork(tokens=97, sampled=1, prefill_attn_pairs=97 * 98 // 2, seqs=1), 0.05, cost))
    return eng_rows, served_rows


def test_fit_on_engine_recovers_the_engine_and_the_served_level():
    eng_rows, served_rows = _rows()
    fit = fit_on_engine(eng_rows, served_rows, threads=1)
    assert fit["served_decode_scale"] == pytest.approx(SCALE, rel=0.02)
    assert fit["served_step_ms"] == pytest.approx(STEP_MS, abs=0.02)
    assert fit["engine_median_error_pct"] < 1.0
    base = _profile()
    for model in MODELS:  # decode steps up to 16 sequences, which the served rows hardly hold
        truth = CostModel(model, base.replace(layouts={"1x1": ENGINE}))
        got = CostModel(model, base.replace(layouts={"1x1": {**SERVED, LAYOUT_DECODE: fit}}))
        for b in (1, 4, 16):
            want = SCALE * truth.step_time(_decode(b)) + STEP_MS * 1e-3
            assert got.step_time(_decode(b)) == pytest.approx(want, rel=0.03)


def test_fit_on_engine_needs_decode_steps():
    eng_rows, served_rows = _rows()
    with pytest.raises(ValueError, match="no decode step"):
        fit_on_engine([r for r in eng_rows if r[0].prefill_attn_pairs], served_rows)


def test_decode_constants_serve_decode_steps_only():
    dec = {**ENGINE, "served_decode_scale": SCALE, "served_step_ms": STEP_MS}
    prof = _profile({"1x1": {**SERVED, LAYOUT_DECODE: dec}})
    plain = _profile({"1x1": SERVED})
    engine = _profile({"1x1": ENGINE})
    model = MODELS[1]
    pre = StepWork(tokens=64, sampled=1, prefill_attn_pairs=64 * 65 // 2, seqs=1)
    mixed = StepWork(tokens=64 + 3, sampled=4, prefill_attn_pairs=64 * 65 // 2, decode_context=3 * 80, seqs=4)
    for w in (pre, mixed):  # a step with a prefill chunk: the served fit, as before
        assert CostModel(model, prof).step_time(w) == CostModel(model, plain).step_time(w)
    for b in (1, 2, 8):
        w = _decode(b)
        assert CostModel(model, prof).step_time(w) == pytest.approx(
            SCALE * CostModel(model, engine).step_time(w) + STEP_MS * 1e-3, rel=1e-9)
    # the served fit's 0.7 ms per sequence would have made 16 sequences cost > 11 ms more than 1
    d16 = CostModel(model, prof).step_time(_decode(16)) - CostModel(model, prof).step_time(_decode(1))
    assert d16 < 0.5 * (CostModel(model, plain).step_time(_decode(16)) - CostModel(model, plain).step_time(_decode(1)))


def test_profile_checks_and_keeps_the_decode_constants(tmp_path):
    dec = {**ENGINE, "served_decode_scale": SCALE, "served_step_ms": STEP_MS, "engine_median_error_pct": 3.0}
    prof = _profile({"1x1": {**SERVED, LAYOUT_DECODE: dec}})
    prof.save(tmp_path / "p.yaml")
    back = load_profile(str(tmp_path / "p.yaml"))
    assert back.layouts["1x1"][LAYOUT_DECODE] == dec
    data = prof.to_dict()
    data["layouts"]["1x1"][LAYOUT_DECODE] = {**dec, "served_decode_scale": -1.0}
    with pytest.raises(ProfileError, match="served_decode_scale"):
        profile_from_dict(data, "unit")
    data["layouts"]["1x1"][LAYOUT_DECODE] = {k: v for k, v in dec.items() if k != "matmul_scale"}
    with pytest.raises(ProfileError, match="matmul_scale"):
        profile_from_dict(data, "unit")


def test_refit_moves_the_decode_constants_too():
    dec = {**ENGINE, "served_decode_scale": SCALE, "served_step_ms": STEP_MS}
    prof = _profile({"1x1": {**SERVED, LAYOUT_DECODE: dec}})
    moved = apply(prof, {"seq": 2.0, "step": 3.0})
    got = moved.layouts["1x1"][LAYOUT_DECODE]
    assert got["seq_overhead_us"] == pytest.approx(2.0 * ENGINE["seq_overhead_us"])
    assert got["served_step_ms"] == pytest.approx(3.0 * STEP_MS)
    assert moved.layouts["1x1"]["seq_overhead_us"] == pytest.approx(2.0 * SERVED["seq_overhead_us"])
    w = _decode(4)
    model = MODELS[0]
    assert CostModel(model, moved).step_time(w) > CostModel(model, prof).step_time(w)
    assert np.isfinite(CostModel(model, moved).step_time(w))


def test_fit_on_engine_tells_the_batch_kernels_per_layer_cost():
    # the engine's decode batches of 2+ rows cost 150 us more per layer than its batch-1 path
    jump = {**ENGINE, "decode_batch_layer_us": 150.0}
    base = _profile()
    eng_rows, served_rows = [], []
    for model in MODELS:
        truth = CostModel(model, base.replace(layouts={"1x1": jump}))
        cost = CostModel(model, base)
        for b, _, _ in DECODE_BATCHES:
            eng_rows += [(_decode(b, ctx), truth.step_time(_decode(b, ctx)), cost) for ctx in (33, 35)]
        served_rows += [(_decode(1, 90 + i), SCALE * truth.step_time(_decode(1, 90 + i)) + STEP_MS * 1e-3, cost)
                        for i in range(10)]
    fit = fit_on_engine(eng_rows, served_rows, threads=1)
    assert fit["decode_batch_layer_us"] == pytest.approx(150.0, rel=0.05)
    got = CostModel(MODELS[3], base.replace(layouts={"1x1": {**SERVED, LAYOUT_DECODE: fit}}))
    d = got.step_time(_decode(2)) - got.step_time(_decode(1))
    assert d > SCALE * MODELS[3].n_layer * 150e-6  # the jump from 1 to 2 sequences, at the served level
