"""The tuner's closed loop: emitted YAML served for real, predicted against measured, the refit."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerConfig
from loadtest.config import SLO
from shardserve.cli import app
from tuner.cost import StepWork
from tuner.emit import deployment
from tuner.profiles import HardwareProfile, ProfileError, load_profile
from tuner.refit import Run, refit
from tuner.search import Candidate
from tuner.simulate import simulate

TINY = ModelConfig(model_type="gpt2", vocab_size=320, n_layer=2, n_head=4, n_embd=64, max_position_embeddings=128,
                   bos_token_id=0, eos_token_id=(0,))


def _cpu_profile(**kw) -> HardwareProfile:
    """A measured-kind CPU profile with plausible 2-core constants (the test checks the loop, not accuracy)."""
    base = {"name": "unit-cpu", "kind": "measured", "memory_gib": 8.0, "hbm_bandwidth_gb_s": 10.0,
            "flops_tflops": {"float32": 0.05, "bfloat16": 0.05}, "intra_node_bandwidth_gb_s": 1.0,
            "inter_node_bandwidth_gb_s": 1.0, "devices_per_node": 2, "cores": 2, "bw_efficiency": 1.0,
            "flops_efficiency": 1.0, "reserved_memory_gib": 1.0, "step_overhead_ms": 2.0, "layer_overhead_us": 200.0,
            "collective_latency_us": 300.0, "request_overhead_ms": 5.0}
    return HardwareProfile(**{**base, **kw})


def test_emit_cpu_layouts_validate():
    """TP/PP layouts on a CPU profile split the host's cores between shards, as the cost model assumes."""
    prof = _cpu_profile()
    one = deployment(Candidate(1, 1, 1, 8, 512, "float32"), "models/x", prof)["models"][0]
    assert one["num_cpus"] == 2 and "shard_num_cpus" not in one and one["engine"]["dtype"] == "float32"
    two = deployment(Candidate(2, 1, 1, 8, 512, "bfloat16"), "models/x", prof)["models"][0]
    assert two["shard_num_cpus"] == 1 and two["engine"]["worker_threads"] == 1
    assert two["engine"]["tensor_parallel_size"] == 2
    pp = deployment(Candidate(1, 2, 1, 8, 512, "bfloat16"), "models/x", prof)["models"][0]
    assert pp["engine"]["pipeline_parallel_size"] == 2 and pp["engine"]["pipeline_microbatches"] == 1


_SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_blocks=64, max_model_len=100)


def _simulated_runs(truth, tp: int, seed: int) -> list:
    """Two Poisson runs (5 and 20 req/s, 30 requests each) 'measured' by simulating `truth`."""
    from tuner.cost import CostModel

    rng = np.random.default_rng(seed)
    runs = []
    for rate in (5.0, 20.0):
        arr = np.cumsum(rng.exponential(1 / rate, 30))
        ins, outs = rng.integers(8, 40, 30), rng.integers(4, 20, 30)
        tr = simulate(CostModel(TINY, truth, tp=tp, weight_dtype="float32").step_time, _SCHED, arr, ins, outs,
                      request_overhead=truth.request_overhead_ms * 1e-3)
        runs.append(Run(TINY, tp, 1, "float32", _SCHED, arr, ins, outs, np.array([t.ttft for t in tr]),
                        np.array([t.tpot for t in tr])))
    return runs


def test_refit_recovers_scaled_coefficients():
    """Requests 'measured' with a profile whose step overhead and matmul are scaled: the refit
    finds the factors from their TTFT and TPOT alone (schedules simulated, as in the closed loop)."""
    from tuner.cost import CostModel

    # matmuls compute-bound and a good share of each step, so that their factor is visible
    truth = _cpu_profile(step_overhead_ms=6.0, flops_tflops={"float32": 0.001})
    start = _cpu_profile(flops_tflops={"float32": 0.002})
    runs = _simulated_runs(truth, tp=1, seed=0)
    fitted, factors = refit(start, runs, free=("matmul", "step", "request"))
    assert factors["step"] == pytest.approx(3.0, rel=0.1)
    assert factors["matmul"] == pytest.approx(2.0, rel=0.1)
    assert fitted.kind == "measured"
    with pytest.raises(ValueError, match="unknown coefficient"):
        refit(start, runs, free=("warp",))
    # a CPU profile with rate tables: a 2-thread shard's matmuls have their own factor (matmul_mt)
    tables = {1: {"float32": {1: 0.002, 64: 0.004}}, 2: {"float32": {1: 0.001, 64: 0.002}}}
    slow = {1: tables[1], 2: {"float32": {1: 0.0005, 64: 0.001}}}
    truth_mt, start_mt = _cpu_profile(matmul_tflops=slow), _cpu_profile(matmul_tflops=tables)
    runs_mt = []
    for run in runs:
        cost = CostModel(TINY, truth_mt, weight_dtype="float32")
        tr = simulate(cost.step_time, _SCHED, run.arrivals, run.input_lens, run.output_lens,
                      request_overhead=truth_mt.request_overhead_ms * 1e-3)
        runs_mt.append(Run(TINY, 1, 1, "float32", _SCHED, run.arrivals, run.input_lens, run.output_lens,
                           np.array([t.ttft for t in tr]), np.array([t.tpot for t in tr])))
    fitted, factors = refit(start_mt, runs_mt, free=("matmul_mt", "step", "request"))
    assert factors["matmul_mt"] == pytest.approx(2.0, rel=0.1)
    assert fitted.matmul_rate("float32", 64, 1) == pytest.approx(truth_mt.matmul_rate("float32", 64, 1), rel=0.1)


def test_refit_extreme_factors_keep_rates_valid():
    """A refit whose matmul factors move far apart (the closed loop on a pass-33 profile drove the
    multi-thread one past 1e3) scales the multi-thread rate table by their ratio: the rates stay
    positive (six significant digits), where rounding to six decimals made a 0.027 TFLOP/s rate 0
    and the refitted profile failed its own check."""
    from tuner.refit import apply

    lay = {"step_overhead_ms": 1.0, "layer_overhead_us": 10.0, "seq_overhead_us": 5.0, "seq_layer_overhead_us": 1.0,
           "matmul_scale": 0.5, "comm_scale": 1.0, "attention_prefill_tflops": 0.1, "attention_kv_gb_s": 10.0}
    prof = _cpu_profile(matmul_tflops={1: {"float32": {1: 0.03, 64: 0.07}}, 2: {"float32": {1: 0.027, 64: 0.08}}},
                        layouts={"1x1": lay, "2x1": lay})
    out = apply(prof, {"matmul": 1e3, "matmul_mt": 1e-3})  # a 2-thread table and one-shard layout x 1e-6
    assert out.matmul_tflops[2]["float32"][1] == pytest.approx(0.027e6, rel=1e-5)
    assert out.matmul_tflops[1] == prof.matmul_tflops[1]
    assert out.layouts["1x1"]["matmul_scale"] == pytest.approx(0.5e-6, rel=1e-5)  # 2 threads: moved by mt / matmul
    out = apply(prof, {"matmul": 1e-3, "matmul_mt": 1e3})
    assert out.matmul_tflops[2]["float32"][1] == pytest.approx(0.027e-6, rel=1e-5)


def test_refit_moves_layout_constants():
    """With per-layout constants (measured through each layout's executor), the refit's factors act
    on the layout's own constants: a TP2 run whose step overhead and matmul are 3x and 2x the
    profile's is refitted to those factors, and the refitted profile predicts it."""
    from tuner.cost import CostModel

    lay = {"step_overhead_ms": 2.0, "layer_overhead_us": 100.0, "seq_layer_overhead_us": 10.0, "seq_overhead_us": 50.0,
           "matmul_scale": 1.0, "comm_scale": 1.0, "attention_prefill_tflops": 0.01, "attention_kv_gb_s": 5.0}
    tables = {1: {"float32": {1: 0.001, 64: 0.002}}, 2: {"float32": {1: 0.002, 64: 0.004}}}
    start = _cpu_profile(matmul_tflops=tables, step_overhead_ms=0.0, layouts={"2x1": lay})
    truth = start.replace(layouts={"2x1": {**lay, "step_overhead_ms": 6.0, "matmul_scale": 2.0}})
    runs = _simulated_runs(truth, tp=2, seed=1)
    fitted, factors = refit(start, runs, free=("matmul", "step", "request"))
    assert factors["step"] == pytest.approx(3.0, rel=0.1)
    assert fitted.layouts["2x1"]["step_overhead_ms"] == pytest.approx(6.0, rel=0.1)
    assert fitted.layouts["2x1"]["layer_overhead_us"] == pytest.approx(100.0)  # not free: unchanged
    w = StepWork(tokens=40, sampled=1, prefill_attn_pairs=40 * 41 // 2)
    assert CostModel(TINY, fitted, tp=2, weight_dtype="float32").step_time(w) == pytest.approx(
        CostModel(TINY, truth, tp=2, weight_dtype="float32").step_time(w), rel=0.1)


def test_validate_rejects_bad_input(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY.to_hf()))
    base = ["tune", "search", "--model", str(cfg), "--input-len", "8", "--output-len", "4", "--num-prompts", "10",
            "--out", str(tmp_path / "o"), "--slo", "ttft_p99_ms=1000", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "256"]  # a small grid: the errors, not the search, are under test
    run = CliRunner().invoke(app, [*base, "--hardware", "a100-80gb", "--validate", "1"])
    assert run.exit_code == 2 and "--validate serves on this machine" in run.output, run.output
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\nmemory_gib: 8\n")
    run = CliRunner().invoke(app, [*base, "--hardware", str(bad)])
    assert run.exit_code == 2 and "missing field(s) hbm_bandwidth_gb_s" in run.output, run.output
    bad.write_text(yaml.safe_dump({**_cpu_profile().to_dict(), "memory_gib": "lots"}))
    run = CliRunner().invoke(app, [*base, "--hardware", str(bad)])
    assert run.exit_code == 2 and "memory_gib" in run.output, run.output
    run = CliRunner().invoke(app, [*base, "--hardware", "a100-80gb", "--tp", "0"])
    assert run.exit_code == 2 and "--tp" in run.output, run.output
    run = CliRunner().invoke(app, [*base, "--hardware", "a100-80gb", "--validate-sweep-tolerance", "1.5"])
    assert run.exit_code == 2 and "--validate-sweep-tolerance: must be in (0, 1), got 1.5" in run.output, run.output
    _cpu_profile().save(tmp_path / "cpu.yaml")
    run = CliRunner().invoke(app, [*base, "--hardware", str(tmp_path / "cpu.yaml"), "--validate", "1",
                                   "--model-path", str(tmp_path / "nowhere")])
    assert run.exit_code == 2 and "no config.json" in run.output, run.output


def test_search_validate_closed_loop(tmp_path):
    """`tune search --validate 1` serves the pick with its emitted YAML on 127.0.0.1, load-tests it,
    and reports predicted against measured, the goodput sweep and a refitted profile."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY.to_hf()))
    # with a host reference: --recalibrate scales the search's profile and the validation's runs to
    # the host's state now (tuner.hostref)
    _cpu_profile(host_reference={"decode_us": 600.0, "read_gb_s": 30.0}).save(tmp_path / "cpu.yaml")
    out = tmp_path / "out"
    # SLOs with room for a CI host whose 2 cores four test workers share: at a 1.5 s TTFT bound every
    # one of the accuracy run's 6 requests missed it once (CI on a9d6bbf) and its measured goodput was 0.
    # A sweep tolerance of 0.5 bisects the bracket [rate, 2 x rate] once (0.3 took a second bisection when
    # the first passed): the sweep is checked for its steps, not its resolution, and that last step was
    # the largest (129 of the 386 requests every polish step of the refit simulates)
    run = CliRunner().invoke(app, ["tune", "search", "--recalibrate", "--model", str(cfg), "--hardware", str(tmp_path / "cpu.yaml"),
                                   "--input-len", "8", "--output-len", "24", "--num-prompts", "20",
                                   "--slo", "ttft_p99_ms=3000", "--slo", "tpot_p99_ms=1000", "--tp", "1", "--pp", "1",
                                   "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                                   "--weight-dtype", "float32", "--validate", "1", "--validate-prompts", "6",
                                   "--validate-min-step-s", "0.1", "--validate-sweep-tolerance", "0.5", "--out", str(out)])
    assert run.exit_code == 0, run.output
    rep = json.loads((out / "validation.json").read_text())
    (c,) = rep["candidates"]
    m, why = c["measured"], (json.dumps(c, default=str)[:3000], run.output[-3000:])
    assert c["accuracy_failed"] == 0, why
    for key in ("ttft_p50_ms", "tpot_p50_ms", "output_throughput_tok_s", "goodput_req_s"):
        assert c["predicted"][key] > 0, (key, *why)
        if key == "goodput_req_s" and m[key] == 0:
            # goodput counts the requests within both SLOs: on a CI host whose 2 cores four test workers share,
            # every one of the 6 requests has missed even the 3 s TTFT bound (twice, the last on c74025a); a
            # zero must then agree with the measured latencies (at least half of the requests past a bound)
            assert m["ttft_p50_ms"] > 3000 or m["tpot_p50_ms"] > 1000, why
            continue
        if key == "tpot_p50_ms" and m["tpot_unmeasured"] == 6:
            # every reply arrived in one network read (the client or gateway descheduled for its whole
            # generation; CI on 7e13be6): no TPOT was measured, which the report must say, not call it 0
            assert math.isnan(m[key]) and math.isnan(c["error"][key]), why
            continue
        assert m[key] > 0 and math.isfinite(c["error"][key]), (key, *why)
    assert c["measured_goodput_req_s"] > 0 and c["sweep"]
    # each sweep step that ran to its end offered its rate for a tenth of a second at least, not a burst of 6
    assert all(st["requests"] >= max(6, math.ceil(st["rate"] * 0.1)) for st in c["sweep"] if not st["stopped_early"])
    assert set(c["host_scale"]) == {"cpu", "memory"} and all(0.5 <= v <= 2.0 for v in c["host_scale"].values())
    # the error against the profile as measured (before the host scale) is defined exactly where the
    # scaled one is: NaN only for a metric the loop above accepted as unmeasured or zero (CI on eedd858)
    assert set(c["error_as_profiled"]) == set(c["error"]), why
    assert all(math.isfinite(v) == math.isfinite(c["error"][k]) for k, v in c["error_as_profiled"].items()), why
    assert rep["pick_within_pct_of_best"] == pytest.approx(0.0)
    assert load_profile(str(out / "refit.yaml")).kind == "measured"
    assert (out / "validation.png").stat().st_size > 1000
    assert "predicted / measured" in run.output


def test_a_reply_read_at_once_has_no_measured_tpot():
    """A reply whose tokens all came in one network read shows TPOT 0: the TPOT p50 leaves it out
    (and says how many it left out) while goodput still counts it as within the SLO."""
    from types import SimpleNamespace

    from loadtest.metrics import RequestRecord
    from tuner.validate import measured_run

    def rec(i, ttft, e2el, gaps):
        return RequestRecord(index=i, warmup=False, scheduled_s=0.1 * i, sent_s=0.1 * i, done_s=0.1 * i + e2el,
                             ttft_s=ttft, e2el_s=e2el, itl_s=gaps, output_tokens=5, requested_output_tokens=5)

    recs = [rec(0, 0.2, 0.2, []), rec(1, 0.1, 0.5, [0.1] * 4), rec(2, 0.1, 0.9, [0.2] * 4)]
    # the same one read parsed as five events (gaps of 0 after the first; CI on 1c971cc): no TPOT measured either
    recs_events = [rec(0, 0.2, 0.2, [0.0] * 4), *recs[1:]]
    run = Run(model=TINY, tp=1, pp=1, weight_dtype="float32", sched=SchedulerConfig(4, 256, 16, 64, 128), arrivals=np.array([0.0, 0.1, 0.2]),
              input_lens=np.full(3, 4), output_lens=np.full(3, 5), ttft_s=np.array([r.ttft_s for r in recs]),
              tpot_s=np.array([r.tpot_s for r in recs]))
    m = measured_run(run, SimpleNamespace(records=recs), (SLO("tpot", 150.0, "p99"),))
    assert m["tpot_unmeasured"] == 1 and m["tpot_p50_ms"] == pytest.approx(150.0)  # of 100 and 200 ms, not of 0 too
    assert m["goodput_req_s"] == pytest.approx(2 / 1.1)  # the one-read reply and the 100 ms one, over 1.1 s
    assert measured_run(run, SimpleNamespace(records=recs_events), (SLO("tpot", 150.0, "p99"),)) == m
    one = measured_run(Run(**{**run.__dict__, "tpot_s": run.tpot_s[:1], "ttft_s": run.ttft_s[:1],
                              "arrivals": run.arrivals[:1]}), SimpleNamespace(records=recs[:1]), ())
    assert math.isnan(one["tpot_p50_ms"]) and one["tpot_unmeasured"] == 1
    # a one-token reply (TPOT 0 by convention, with or without a gap) measures no TPOT either
    single = RequestRecord(index=0, warmup=False, scheduled_s=0.0, sent_s=0.0, done_s=0.3, ttft_s=0.3, e2el_s=0.3,
                           itl_s=[], output_tokens=1, requested_output_tokens=5)
    m1 = measured_run(Run(**{**run.__dict__, "tpot_s": np.array([0.0, 0.1]), "ttft_s": np.array([0.3, 0.1]),
                             "arrivals": run.arrivals[:2]}), SimpleNamespace(records=[single, recs[1]]), ())
    assert m1["tpot_unmeasured"] == 1 and m1["tpot_p50_ms"] == pytest.approx(100.0)  # not the p50 of 0 and 100


def test_cpu_host_is_one_device():
    """On a CPU profile the grid keeps layouts within the host's cores, one replica each, and
    goodput per device is per host (TP does not divide it)."""
    from tuner.search import Workload, evaluate, grid

    cands = grid(TINY, devices=8, tps=(1, 2, 4), pps=(1, 2), seqs=(4,), tokens=(256,), dtypes=("float32",), cores=2)
    assert {(c.tp, c.pp, c.replicas) for c in cands} == {(1, 1, 1), (2, 1, 1), (1, 2, 1)}
    slo = (SLO("ttft", 5000.0, "p99"),)
    done = evaluate(TINY, _cpu_profile(), cands, Workload(8, 4, 20), slo)
    for c in done:
        assert c.metrics["devices"] == 1
        assert c.metrics["goodput_per_device"] == pytest.approx(c.metrics["goodput_req_s"])


def test_probes_serve_as_deployed():
    """The profile's probe copies run with the engine options the tuner deploys (tuner.emit): the
    one-shard copy leaves the thread count to the engine (no worker_threads: its adaptive chooser,
    at most OMP_NUM_THREADS = every core, as Ray sets it for the deployed replica), several shards
    fix one thread each; only the CPU reservations are fractions, so that every copy fits."""
    from pathlib import Path

    from tuner.measure_served import probe_models, server_env

    prof = _cpu_profile()
    copies = {"a-1x1": (Path("/p/a"), 1, 1), "a-2x1": (Path("/p/a"), 2, 1), "a-1x2": (Path("/p/a"), 1, 2)}
    models = {m["name"]: m for m in probe_models(copies, prof, "bfloat16")}
    for name, (_, tp, pp) in copies.items():
        deployed = deployment(Candidate(tp, pp, 1, 16, 1024, "bfloat16"), "/p/a", prof, name=name)["models"][0]
        assert models[name]["engine"] == deployed["engine"]
    assert "worker_threads" not in models["a-1x1"]["engine"]
    assert models["a-2x1"]["engine"]["worker_threads"] == 1 and models["a-1x2"]["engine"]["worker_threads"] == 1
    assert sum(m["num_cpus"] + m.get("shard_num_cpus", 0) * 2 for m in models.values()) < 1
    assert server_env(prof) == {"OMP_NUM_THREADS": "2"}


def test_serving_cores_fix_the_one_shard_engine_threads():
    """A profile that keeps a core for the serving side (`tune profile` measures so by default)
    deploys a one-shard copy on every core's reservation with its engine fixed at the rest
    (worker_threads), and the probes serve it so; several shards split the cores as before."""
    from pathlib import Path

    from tuner.measure_served import probe_models

    prof = _cpu_profile(cores=4, devices_per_node=4, serving_cores=1)
    assert (prof.threads(1), prof.threads(2), prof.threads(4)) == (3, 2, 1)
    one = deployment(Candidate(1, 1, 1, 8, 512, "bfloat16"), "models/x", prof)["models"][0]
    assert one["num_cpus"] == 4 and one["engine"]["worker_threads"] == 3
    two = deployment(Candidate(2, 1, 1, 8, 512, "bfloat16"), "models/x", prof)["models"][0]
    assert two["engine"]["worker_threads"] == 2 and two["shard_num_cpus"] == 2
    probe = probe_models({"a-1x1": (Path("/p/a"), 1, 1)}, prof, "bfloat16")[0]
    assert probe["engine"]["worker_threads"] == 3
    with pytest.raises(ProfileError, match="serving_cores"):
        _cpu_profile(serving_cores=2)  # every core of the host: nothing left for the engine


def test_scheduler_kv_cap_counts_the_bos_token():
    """The simulator's KV blocks are capped at max_num_seqs requests of max_model_len tokens (the
    workload's input + output + the tokenizer's BOS): all max_num_seqs requests fit at once, as in
    the served engine whose cache is sized from memory."""
    from engines.core.sampling_params import SamplingParams
    from engines.core.scheduler import Scheduler
    from engines.core.sequence import Sequence
    from tuner.cost import CostModel
    from tuner.search import Workload, scheduler_config

    prof = _cpu_profile()
    model = ModelConfig(model_type="gpt2", vocab_size=320, n_layer=2, n_head=4, n_embd=64, max_position_embeddings=1024)
    cand = Candidate(1, 1, 1, 8, 512, "bfloat16")
    cfg = scheduler_config(cand, model, CostModel(model, prof), Workload(64, 32, 10))
    assert cfg.max_model_len == 97
    # every request starts in the first step, the last one's first chunk too (512 of the 520 prompt tokens): the
    # blocks take them all (whole_prompt_steps off, or the eighth would wait a step for its budget, not its blocks)
    sched = Scheduler(dataclasses.replace(cfg, whole_prompt_steps=False))
    for i in range(8):  # 65 prompt tokens (BOS + 64), 32 output tokens each
        sched.add(Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1] * 65, prompt_len=65,
                           params=SamplingParams(max_tokens=32, ignore_eos=True)))
    plan = sched.schedule()
    assert len(plan.prefill) == 8


def test_overhead_per_held_sequence_fits_back():
    """Open-loop TTFTs simulated with a known overhead per sequence held at arrival (2 ms) are fitted
    back to it, each copy with its own constant overhead; with 0 the simulator is unchanged."""
    from tuner.measure_served import overhead_per_seq_s
    from tuner.simulate import simulate

    def step(w):
        return 2e-3 + 1e-3 * w.seqs + 2e-5 * w.tokens

    rng = np.random.default_rng(0)
    runs = []
    for base in (5e-3, 9e-3):
        arr = np.cumsum(rng.exponential(0.02, 24))
        il, ol = np.full(24, 40), np.full(24, 12)
        truth = simulate(step, _SCHED, arr, il, ol, request_overhead=base, overhead_per_seq=2e-3)
        plain = simulate(step, _SCHED, arr, il, ol, request_overhead=base)
        assert plain == simulate(step, _SCHED, arr, il, ol, request_overhead=base, overhead_per_seq=0.0)
        assert np.median([t.ttft for t in truth]) > np.median([t.ttft for t in plain])
        runs.append((step, _SCHED, arr, il, ol, np.array([t.ttft for t in truth]), base))
    per_seq, loss = overhead_per_seq_s(runs)
    assert per_seq == pytest.approx(2e-3, abs=2e-4) and loss < 0.01
