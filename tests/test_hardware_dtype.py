"""engines/core/hardware.py and the engine's dtype="auto": bf16 hardware detection from the CPU flags
(posed as AMX, AVX512-BF16, AVX2-only and Arm CPUs), CUDA, the probe harness, and a real engine
that resolves its config once into the concrete dtype every derived value sees."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engines.core import hardware
from engines.core.config import ConfigError, EngineConfig, ModelConfig, kv_bytes_per_block, resolved_dtype
from engines.core.hardware import (
    Rates,
    choose_precision,
    detect,
    engine_dtype,
    read_cpu_flags,
    time_precisions,
)

AVX2 = frozenset(["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"])
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # Cascade Lake: no native bf16
AVX512_BF16 = AVX512 | {"avx512_bf16"}  # Cooper Lake, Zen 4
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}  # Sapphire Rapids
FAST_BF16 = Rates(bf16=9000.0, fp32=3000.0, seconds=0.1)
SLOW_BF16 = Rates(bf16=60.0, fp32=2200.0, seconds=0.1)


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(x86) == {"fpu", "avx2", "amx_bf16", "avx512_bf16"}  # the first processor's
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert "bf16" in read_cpu_flags(arm)
    assert read_cpu_flags(tmp_path / "missing") is None
    assert hardware.cpu_name(x86) == "Intel Xeon"


@pytest.mark.parametrize("flags, bf16, feature", [
    (AMX, True, "AMX + AVX512-BF16"),
    (AVX512_BF16, True, "AVX512-BF16"),
    (AVX512, False, "AVX512F only"),
    (AVX2, False, "AVX2 only"),
    (frozenset({"fp", "asimd", "bf16"}), True, "Arm BF16"),
])
def test_detect_bf16_hardware_from_flags(flags, bf16, feature):
    hw = detect("cpu", cpu_flags=flags)
    assert hw.device_type == "cpu" and hw.bf16 is bf16 and hw.feature.startswith(feature), hw


@pytest.mark.parametrize("flags, rates, want", [
    (AMX, FAST_BF16, "bfloat16"),
    (AVX512_BF16, FAST_BF16, "bfloat16"),
    (AVX512, None, "float32"),
    (AVX2, None, "float32"),
    # bf16 flags, but the probe finds no native kernels (a torch build without them): fp32
    (AMX, Rates(bf16=900.0, fp32=1000.0, seconds=0.1), "float32"),
])
def test_engine_dtype_auto_on_cpus(flags, rates, want):
    choice = engine_dtype("cpu", cpu_flags=flags, rates=rates)
    assert choice.precision == want, choice
    assert choice.reason.startswith(f"dtype auto -> {want}")


def test_engine_dtype_auto_on_cuda():
    assert engine_dtype("cuda", cpu_flags=AVX2, cuda_bf16=True).precision == "bfloat16"
    assert engine_dtype("cuda", cpu_flags=AMX, cuda_bf16=False).precision == "float32"


def test_no_probe_without_bf16_hardware(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("no bf16 hardware: nothing to time")

    monkeypatch.setattr(hardware, "time_precisions", fail)
    assert engine_dtype("cpu", 384, 1536, cpu_flags=AVX2).precision == "float32"


def test_bf16_cpu_is_confirmed_by_a_forward_probe(monkeypatch):
    calls = []

    def fake(run, batch, seq_len, budget_s, key):
        calls.append((batch, seq_len, key))
        run("bf16", 1, 8)  # the real forward of the model's matmul shapes runs in both dtypes
        run("fp32", 1, 8)
        return SLOW_BF16

    monkeypatch.setattr(hardware, "time_precisions", fake)
    assert engine_dtype("cpu", 64, 256, cpu_flags=AMX).precision == "float32"
    assert calls and calls[0][2] == ("forward", "cpu", 64, 256)


def test_time_precisions_measures_and_caches():
    per_token = {"bf16": 2e-5, "fp32": 1e-4}  # bf16 5x faster

    def run(precision, batch, seq_len):
        time.sleep(per_token[precision] * batch * seq_len)

    key = ("test", time.time())
    rates = time_precisions(run, batch=4, seq_len=64, budget_s=2.0, key=key)
    assert 2.0 < rates.ratio < 8.0, rates
    assert time_precisions(lambda *a: pytest.fail("cached"), 4, 64, key=key) is rates


def test_a_very_slow_precision_is_rated_by_its_warm_up_only():
    seen = []

    def run(precision, batch, seq_len):
        seen.append((precision, batch, seq_len))
        time.sleep((0.05 if precision == "bf16" else 1e-4) * seq_len / 16)

    rates = time_precisions(run, batch=16, seq_len=256, budget_s=1.0, warmup_tokens=16)
    assert ("bf16", 16, 256) not in seen and ("fp32", 16, 256) in seen  # the slow one never ran in full
    assert rates.fp32 > 20 * rates.bf16


def test_choose_precision_rules():
    cpu = detect("cpu", cpu_flags=AVX2)
    assert choose_precision("auto", cpu, SLOW_BF16).precision == "fp32"
    assert choose_precision("auto", cpu, FAST_BF16).precision == "bf16"
    assert choose_precision("auto", cpu, Rates(1030.0, 1000.0, 0.1)).precision == "fp32"  # a near-tie: fp32
    with pytest.raises(ValueError, match="precision: must be auto, bf16 or fp32"):
        choose_precision("fp16", cpu)


def test_config_accepts_auto_and_names_the_field():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype: must be one of auto, float32, bfloat16, float16, got 'int8'"):
        EngineConfig(dtype="int8")


def test_kv_sizing_of_an_unresolved_config_follows_the_hardware(monkeypatch):
    cfg = ModelConfig(model_type="gpt2", vocab_size=100, n_layer=2, n_head=4, n_embd=64)
    monkeypatch.setattr(hardware, "read_cpu_flags", lambda *a: AVX2)
    assert resolved_dtype(EngineConfig()) == "float32"
    assert kv_bytes_per_block(cfg, EngineConfig()) == kv_bytes_per_block(cfg, EngineConfig(dtype="float32"))
    monkeypatch.setattr(hardware, "read_cpu_flags", lambda *a: AMX)
    assert kv_bytes_per_block(cfg, EngineConfig()) == kv_bytes_per_block(cfg, EngineConfig(dtype="bfloat16"))


@pytest.mark.parametrize("flags, want", [(AMX, torch.bfloat16), (AVX2, torch.float32)])
def test_engine_resolves_auto_once(gpt2_dir, monkeypatch, caplog, flags, want):
    from engines.core.llm_engine import LLMEngine
    from engines.core.sampling_params import SamplingParams

    monkeypatch.setattr(hardware, "read_cpu_flags", lambda *a: flags)
    monkeypatch.setattr(hardware, "time_precisions", lambda *a, **k: FAST_BF16)
    requested = EngineConfig(num_kv_blocks=0, kv_cache_bytes=2**20)
    with caplog.at_level(logging.INFO, logger="engines.core.config"):
        engine = LLMEngine(gpt2_dir, requested)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[want]
    assert requested.dtype == "auto"  # the caller's config is not changed; the engine holds a new one
    assert engine.config.dtype == name and engine.config == requested.replace(dtype=name)
    runner = engine.executor.runner
    assert runner.dtype == want and runner.cache.data.dtype == want
    assert next(runner.model.parameters()).dtype == want
    assert engine.executor.num_blocks == 2**20 // kv_bytes_per_block(engine.model_config, engine.config)
    assert any(f"dtype auto -> {name}" in r.getMessage() for r in caplog.records)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
