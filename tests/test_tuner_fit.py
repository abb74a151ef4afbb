"""Tuner: the served-step fit on a bimodal spread of steps (some on the slow thread count)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.core.config import ModelConfig
from tuner.cost import CostModel, StepWork
from tuner.measure_engine import fit_layout
from tuner.profiles import HardwareProfile

MODELS = [ModelConfig(model_type="gpt2", vocab_size=v, n_layer=n, n_head=4, n_embd=c, max_position_embeddings=512)
          for n, c, v in ((2, 128, 2048), (6, 256, 512), (4, 64, 8192), (8, 128, 1024))]
TRUTH = {"step_overhead_ms": 0.5, "layer_overhead_us": 100.0, "seq_layer_overhead_us": 10.0, "seq_overhead_us": 80.0,
         "matmul_scale": 1.0, "comm_scale": 1.0, "attention_prefill_tflops": 0.05, "attention_kv_gb_s": 3.0,
         "vocab_seq_ns": 0.0, "token_layer_width_ns": 0.5, "head_ns": 0.0}


def _profile() -> HardwareProfile:
    return HardwareProfile(name="unit", memory_gib=1.0, hbm_bandwidth_gb_s=1.0, flops_tflops={"bfloat16": 1e-3},
                           intra_node_bandwidth_gb_s=1.0, inter_node_bandwidth_gb_s=1.0, collective_latency_us=0.0,
                           reserved_memory_gib=0.0, cores=2,
                           matmul_tflops={1: {"bfloat16": {1: 0.01, 64: 0.1}}, 2: {"bfloat16": {1: 0.02, 64: 0.2}}})


def _steps(slow_every: int, slow: float):
    """The one-shard formula's steps of four probes, every `slow_every`-th stretched `slow`-fold (a
    young class's two-thread step, a burst's): (rows for fit_layout, the unstretched times)."""
    prof = _profile()
    works = [StepWork(tokens=b * n, sampled=b, prefill_attn_pairs=b * n * (n + 1) // 2)
             for b, n in ((1, 16), (1, 64), (2, 64), (1, 97), (3, 97))]
    works += [StepWork(tokens=b, sampled=b, decode_context=b * c) for b in (1, 2, 3, 4, 6, 8, 12) for c in (20, 90)]
    rows, fast = [], []
    for model in MODELS:
        truth = CostModel(model, prof.replace(layouts={"1x1": TRUTH}))
        for rep in range(3):
            for i, w in enumerate(works):
                t = truth.step_time(w)
                stretched = t * slow if (i + rep) % slow_every == 0 else t
                rows.append((w, stretched, CostModel(model, prof)))
                fast.append(t)
    return rows, np.array(fast)


def _predicted(fit: dict, rows) -> np.ndarray:
    prof = _profile()
    lay = {k: v for k, v in fit.items() if k in TRUTH or k == "dram_weight_gb_s"}
    return np.array([CostModel(c.model, prof.replace(layouts={"1x1": lay})).step_time(w) for w, _, c in rows])


def test_typical_fit_follows_the_fast_mode():
    # a quarter of the steps twice as long: the typical fit gives the steps a deployment runs
    # (its classes on the faster count), the mean fit lands between the modes
    rows, fast = _steps(slow_every=4, slow=2.0)
    typical = _predicted(fit_layout(rows, threads=2), rows) / fast
    mean = _predicted(fit_layout(rows, threads=2, mean=True), rows) / fast
    assert np.median(typical) == pytest.approx(1.0, abs=0.05)
    assert np.median(mean) > 1.1


def test_both_fits_agree_without_slow_steps():
    rows, fast = _steps(slow_every=10**9, slow=1.0)
    for mean in (False, True):
        assert _predicted(fit_layout(rows, threads=2, mean=mean), rows) / fast == pytest.approx(1.0, abs=1e-3)
