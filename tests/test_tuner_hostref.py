"""Tuner: the host-state reference and a profile recalibrated by it (tuner.hostref)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engines.core.config import ModelConfig
from tuner.cost import COMPONENTS, CostModel, StepWork
from tuner.hostref import (
    SCALE_RANGE,
    combine,
    host_reference,
    host_scales,
    recalibrated,
    reference_without_server,
    server_processes,
)
from tuner.profiles import HardwareProfile, ProfileError, load_profile

LAYOUT = {"step_overhead_ms": 0.5, "layer_overhead_us": 100.0, "seq_layer_overhead_us": 10.0, "seq_overhead_us": 80.0,
          "matmul_scale": 1.3, "comm_scale": 2.0, "attention_prefill_tflops": 0.05, "attention_kv_gb_s": 3.0,
          "token_layer_width_ns": 0.5, "prefill_step_ms": 1.5, "dram_weight_gb_s": 20.0}
# 12 layers of width 768 and a 50,257-entry head in bf16: ~250 MB, past twice the 32 MiB cache
GPT2 = ModelConfig(model_type="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_embd=768, max_position_embeddings=1024)
WORKS = [StepWork(tokens=64, sampled=1, prefill_attn_pairs=64 * 65 // 2),
         StepWork(tokens=4, sampled=4, decode_context=4 * 80)]


def _profile(**kw) -> HardwareProfile:
    return HardwareProfile(name="unit", kind="measured", memory_gib=8.0, hbm_bandwidth_gb_s=30.0,
                           flops_tflops={"bfloat16": 0.4}, intra_node_bandwidth_gb_s=1.0, inter_node_bandwidth_gb_s=1.0,
                           collective_latency_us=400.0, reserved_memory_gib=0.0, cores=2, cache_mib=32.0,
                           matmul_tflops={1: {"bfloat16": {1: 0.02, 64: 0.2}}, 2: {"bfloat16": {1: 0.03, 64: 0.4}}},
                           layouts={"1x1": LAYOUT, "2x1": LAYOUT}, request_overhead_ms=7.0,
                           host_reference={"decode_us": 600.0, "read_gb_s": 32.0, "steal_pct": 0.0}, **kw)


def test_scales_are_time_ratios_now_against_the_profile_clamped():
    then = {"decode_us": 600.0, "read_gb_s": 32.0}
    assert host_scales(then, {"decode_us": 450.0, "read_gb_s": 64.0}) == {"cpu": 0.75, "memory": 0.5}
    assert host_scales(then, {"decode_us": 900.0, "read_gb_s": 24.0}) == {"cpu": 1.5, "memory": pytest.approx(4 / 3, rel=1e-3)}
    lo, hi = SCALE_RANGE
    assert host_scales(then, {"decode_us": 6000.0, "read_gb_s": 1.0}) == {"cpu": hi, "memory": hi}
    assert host_scales(then, {"decode_us": 6.0, "read_gb_s": 1e4}) == {"cpu": lo, "memory": lo}
    assert host_scales({}, {"decode_us": 450.0}) == {"cpu": 1.0, "memory": 1.0}
    both = combine([{"decode_us": 400.0, "read_gb_s": 20.0, "steal_pct": 1.0},
                    {"decode_us": 900.0, "read_gb_s": 45.0, "steal_pct": 3.0}])
    assert both["decode_us"] == pytest.approx(600.0) and both["read_gb_s"] == pytest.approx(30.0)
    assert both["steal_pct"] == 2.0 and both["samples"] == 2
    assert (both["decode_us_first"], both["decode_us_last"]) == (400.0, 900.0)
    # a diagnostic in one reference only (the probe server's, taken once) is kept as it is
    one = combine([{"decode_us": 400.0, "read_gb_s": 20.0, "served_decode_us": 700.0}, {"decode_us": 900.0, "read_gb_s": 45.0}])
    assert one["served_decode_us"] == 700.0 and "steal_pct" not in one


@pytest.mark.parametrize("tp", [1, 2])
def test_recalibration_scales_cpu_terms_by_cpu_and_weight_streaming_by_memory(tp):
    prof = _profile()
    # the weight-streaming term alone: the same step with and without it
    no_dram = prof.replace(layouts={k: {**v, "dram_weight_gb_s": 0.0} for k, v in prof.layouts.items()})
    for w in WORKS:
        base, base_cpu = CostModel(GPT2, prof, tp=tp), CostModel(GPT2, no_dram, tp=tp)
        stream = base.step_time(w) - base_cpu.step_time(w)
        assert stream > 0.05 * base.step_time(w)  # the case tests something: GPT-2 streams its weights
        scaled = recalibrated(prof, {"decode_us": 900.0, "read_gb_s": 16.0})  # cpu x1.5, memory x2
        assert scaled.host_scale == {"cpu": 1.5, "memory": 2.0}
        s = CostModel(GPT2, scaled, tp=tp)
        assert s.step_time(w) == pytest.approx(1.5 * base_cpu.step_time(w) + 2.0 * stream, rel=1e-9)
        parts, parts0 = s.components(w), base_cpu.components(w)
        for k in COMPONENTS:
            if k not in ("matmul", "matmul_mt"):
                assert parts[k] == pytest.approx(1.5 * parts0[k], rel=1e-9, abs=1e-15)
    assert recalibrated(prof, {"decode_us": 300.0, "read_gb_s": 32.0}).request_overheads_s(1, 1)[0] \
        == pytest.approx(0.5 * 7e-3)
    # without a reference in the profile: unchanged
    bare = prof.replace(host_reference={})
    assert recalibrated(bare, {"decode_us": 900.0, "read_gb_s": 16.0}) is bare


def test_profile_yaml_keeps_the_reference_and_checks_the_scale(tmp_path):
    path = tmp_path / "p.yaml"
    _profile().save(path)
    assert load_profile(str(path)).host_reference["decode_us"] == 600.0
    with pytest.raises(ProfileError, match="host_scale"):
        _profile(host_scale={"gpu": 1.0})
    with pytest.raises(ProfileError, match="host_scale"):
        _profile(host_scale={"cpu": 0.0})


def test_server_processes_are_counted_from_proc(tmp_path):
    for pid, cmd in ((10, b"/usr/bin/python\0-m\0shardserve.cli\0serve\0--config\0x.yaml"),
                     (11, b"/site-packages/ray/core/src/ray/raylet/raylet\0--node"), (12, b"ray::ServeReplica:tuned"),
                     (13, b"/usr/bin/python\0benchmarks/bench_tuner.py"), (14, b"")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmd)
    (tmp_path / "self").mkdir()
    assert server_processes(tmp_path) == 3
    assert server_processes(tmp_path / "none") == 0


def test_host_reference_measures_this_host():
    ref = host_reference(budget_s=0.2)
    assert ref["decode_us"] > 0 and ref["read_gb_s"] > 0 and ref["matmul_us"] > 0 and 0 <= ref["steal_pct"] <= 100
    quick = reference_without_server(max_wait_s=0.0, budget_s=0.1)
    assert quick["decode_us"] > 0 and quick["waited_s"] >= 0 and quick["left"] >= 0


def test_predict_recalibrate(tmp_path):
    from shardserve.cli import app

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_layer": 12, "n_head": 12,
                               "n_embd": 768, "n_positions": 1024}))
    args = ["tune", "predict", "--model", str(cfg), "--batch", "2", "--input-len", "16", "--output-len", "4"]
    run = CliRunner().invoke(app, [*args, "--hardware", "a100-80gb", "--recalibrate"])
    assert run.exit_code == 2 and "--recalibrate" in run.output and "host_reference" in run.output, run.output
    path = tmp_path / "p.yaml"
    _profile().save(path)
    run = CliRunner().invoke(app, [*args, "--hardware", str(path), "--recalibrate"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.output)
    lo, hi = SCALE_RANGE
    assert lo <= out["host_scale"]["cpu"] <= hi and lo <= out["host_scale"]["memory"] <= hi
