"""Tuner: cost-model formulas, the simulator against hand-computed schedules, pruning, bad input."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerConfig
from loadtest.config import SLO
from shardserve.cli import app
from training.distributed import free_port
from tuner.cost import CostModel, LayoutError, StepWork, layout_problem, static_batch
from tuner.profiles import HardwareProfile, ProfileError, builtin_names, load_profile
from tuner.simulate import simulate, summarize

TINY = ModelConfig(model_type="gpt2", vocab_size=100, n_layer=2, n_head=4, n_embd=32, max_position_embeddings=64)


def _profile(**kw) -> HardwareProfile:
    base = {"name": "unit", "memory_gib": 1.0, "hbm_bandwidth_gb_s": 1.0, "flops_tflops": {"bfloat16": 1e-3},
                "intra_node_bandwidth_gb_s": 1.0, "inter_node_bandwidth_gb_s": 1.0, "bw_efficiency": 1.0,
                "flops_efficiency": 1.0, "collective_latency_us": 0.0, "reserved_memory_gib": 0.0}
    return HardwareProfile(**{**base, **kw})


def test_step_time_by_hand():
    # 1 GB/s and 1 GFLOP/s, no overheads: per layer max(2*P*T/F, 2*P/B) + attention; head likewise.
    cost = CostModel(TINY, _profile(), tp=1, pp=1, weight_dtype="bfloat16")
    p = cost.layer_params
    assert p == pytest.approx(12 * 32 * 32 + 13 * 32)  # 4 C^2 + 8 C^2 weights, 13 C biases + norms
    t = cost.step_time(StepWork(tokens=4, sampled=1, decode_context=10))
    layer = max(2 * p * 4 / 1e9, 2 * p / 1e9) + 2 * 4 * 8 * 2 * 10 / 1e9
    head = max(2 * 100 * 32 / 1e9, 100 * 32 * 2 / 1e9)
    assert t == pytest.approx(2 * layer + head)
    # fp8 halves the weight bytes; TP 2 halves the per-device weights and adds all-reduces
    assert cost.weight_bytes_per_device() == pytest.approx(2 * p * 2 + (100 + 64) * 32 * 2)
    fp8 = CostModel(TINY, _profile(), weight_dtype="fp8")
    assert fp8.weight_bytes_per_device() == pytest.approx(cost.weight_bytes_per_device() / 2)
    tp2 = CostModel(TINY, _profile(collective_latency_us=5.0), tp=2)
    assert tp2.kv_bytes_per_token() == cost.kv_bytes_per_token() / 2
    assert tp2._allreduce(1000) == pytest.approx(5e-6 + 1000 / 1e9)


def test_static_batch_adds_prefill_and_decode_steps():
    cost = CostModel(TINY, _profile(step_overhead_ms=1.0))
    out = static_batch(cost, batch=2, input_len=3, output_len=4)
    pre = cost.step_time(StepWork(6, 2, prefill_attn_pairs=2 * 6))
    dec = [cost.step_time(StepWork(2, 2, decode_context=2 * c)) for c in (4, 5, 6)]
    assert out["latency_ms"] == pytest.approx((pre + sum(dec)) * 1e3)
    assert out["ttft_ms"] == pytest.approx(pre * 1e3)
    assert out["throughput_tok_s"] == pytest.approx(8 / (pre + sum(dec)))


def test_simulator_reproduces_hand_schedule():
    # constant 10 ms steps; budget 8 tokens: A (6 prompt tokens) arrives at 0, B (6) at 0.005.
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_blocks=64, max_model_len=64)
    traces = simulate(lambda w: 0.010, cfg, np.array([0.0, 0.005]), np.array([6, 6]), np.array([3, 2]))
    a, b = traces
    # step 1 [0, .01): A's prefill (6) -> A's token 1 at .01; B arrived at .005 but waits for the
    # step's end. Step 2: A's decode + B's prefill (1 + 6 <= 8) -> both get a token at .02.
    assert a.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert b.token_times == pytest.approx([0.02, 0.03])
    assert b.ttft == pytest.approx(0.015)
    s = summarize(traces)
    assert s["output_throughput_tok_s"] == pytest.approx(5 / 0.03)


def test_simulator_chunks_long_prompts():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, block_size=4, num_blocks=64, max_model_len=64)
    seen = []
    traces = simulate(lambda w: seen.append(w.tokens) or 1.0, cfg, np.array([0.0]), np.array([10]), np.array([2]))
    assert seen == [4, 4, 2, 1]  # 10-token prompt in chunks of 4, then one decode
    assert traces[0].token_times == [3.0, 4.0]


def test_goodput_is_a_sustained_rate():
    """The search's goodput is the highest rate a replica sustains within the SLOs: each rate is
    simulated for 5 x the largest TTFT / E2EL bound at least (sustain_s), so a loose TTFT SLO no
    longer passes rates far past saturation on a burst of num_prompts requests; with no latency
    bound (TPOT only) there is nothing a queue moves, and the count bounds the run as before."""
    from tuner.search import SUSTAIN_MAX_REQUESTS, Workload, _run, goodput, sustain_s

    assert sustain_s((SLO("ttft", 400.0, "p99"), SLO("e2el", 2000.0, "p50"), SLO("tpot", 50.0, "p99"))) == 10.0
    assert sustain_s((SLO("tpot", 50.0, "p99"),)) == 0.0
    cost = CostModel(TINY, _profile(step_overhead_ms=10.0))
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64, max_model_len=64)
    w = Workload(input_len=8, output_len=8, num_prompts=10)
    sat = 4 / (static_batch(cost, 4, 8, 8)["latency_ms"] / 1e3)  # full batches back to back, ~50 req/s
    loose = (SLO("ttft", 500.0, "p99"),)
    # the flaw: ten requests at 4x saturation arrive in 50 ms and all start within 500 ms; the same
    # rate for 2.5 s does not
    assert _run(cost, cfg, w, 4 * sat)["ttft_p99_ms"] <= 500.0 < _run(cost, cfg, w, 4 * sat, sustain_s(loose))["ttft_p99_ms"]
    rate, stats = goodput(cost, cfg, w, loose)
    assert 0.5 * sat <= rate <= 1.3 * sat and stats["ttft_p99_ms"] <= 500.0
    big = _run(cost, cfg, w, 1e6, 5.0)  # the simulation's bound: SUSTAIN_MAX_REQUESTS requests of 8 tokens
    assert big["output_throughput_tok_s"] * big["duration_s"] == pytest.approx(SUSTAIN_MAX_REQUESTS * 8)


def test_pruning_reasons():
    assert "n_head" in layout_problem(TINY, 3, 1)
    assert "pipeline stages" in layout_problem(TINY, 1, 3)
    assert layout_problem(TINY, 2, 2) is None
    with pytest.raises(LayoutError, match="weight_dtype"):
        CostModel(TINY, _profile(), weight_dtype="int4")
    big = ModelConfig(model_type="gpt2", vocab_size=51200, n_layer=44, n_head=48, n_embd=6144,
                      max_position_embeddings=2048)
    a100 = load_profile("a100-80gb")
    assert not static_batch(CostModel(big, a100), 256, 128, 200)["fits"]  # KV of 256 x 328 tokens: ~90 GB
    assert static_batch(CostModel(big, a100, tp=8), 1, 60, 20)["fits"]


def test_published_triton_request_cost():
    """FasterTransformer's GPT-175B / GPT-89B tables are latencies through Triton: a constant per
    request, fitted on GPT-89B alone by the closed form of least squared relative error, is added
    to those rows only; the engine-only rows and the device fit's points are left as they were."""
    from tuner.published import POINTS, Point, compare, device_points, fit_triton_request_ms, predict

    a100 = load_profile("a100-80gb")
    pts = [Point("gpt-89b", 8, 1, 128, 8, 0.0, True, True), Point("gpt-89b", 8, 4, 128, 8, 0.0, True, True)]
    base = [predict(a100, p) for p in pts]
    # published = engine + 50 ms and engine + 70 ms: the relative-error optimum weighs each by 1/m^2
    meas = [base[0] + 50.0, base[1] + 70.0]
    pts = [Point(p.model, p.tp, p.batch, p.input_len, p.output_len, m, True, True) for p, m in zip(pts, meas)]
    want = (50 / meas[0] ** 2 + 70 / meas[1] ** 2) / (1 / meas[0] ** 2 + 1 / meas[1] ** 2)
    assert fit_triton_request_ms(a100, pts) == pytest.approx(want)
    assert predict(a100, pts[0], 40.0) == pytest.approx(base[0] + 40.0)
    engine_only = next(p for p in POINTS if p.model == "gpt-20b")
    assert predict(a100, engine_only, 40.0) == pytest.approx(predict(a100, engine_only))
    assert all(not p.via_triton for p in device_points())
    rows = compare(a100)
    held = [r for r in rows if r["model"] == "gpt-175b"]
    assert held and not any(r["fitted"] for r in held) and all("triton_request_ms" in r for r in held)
    assert not any("triton_request_ms" in r for r in rows if r["model"] == "gpt-20b")


def test_profile_cli_rejects_serving_cores_the_host_lacks(tmp_path):
    """`tune profile --serving-cores N` needs N below this host's cores (the engine keeps one at
    least): a bad N fails at once, naming the option, before anything is measured."""
    import os

    cores = len(os.sched_getaffinity(0))
    for bad in (-1, cores):
        run = CliRunner().invoke(app, ["tune", "profile", "--out", str(tmp_path / "p.yaml"), "--serving-cores", str(bad)])
        assert run.exit_code == 2 and "--serving-cores" in run.output and f"{cores} cores" in run.output, run.output
        assert not (tmp_path / "p.yaml").exists()


def test_profiles_load_and_reject():
    for name in ("a100-80gb", "h100-sxm", "h200"):
        assert load_profile(name).hbm_bandwidth_gb_s > 1000
    with pytest.raises(ProfileError, match="unknown profile 'tpu'"):
        load_profile("tpu")
    with pytest.raises(ProfileError, match="bw_efficiency"):
        _profile(bw_efficiency=1.5)


def test_predict_cli(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 51200, "n_layer": 44, "n_head": 48,
                               "n_embd": 6144, "n_positions": 2048}))
    run = CliRunner().invoke(app, ["tune", "predict", "--model", str(cfg), "--hardware", "a100-80gb", "--tp", "4",
                                   "--batch", "1", "--input-len", "60", "--output-len", "20"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.output)
    assert set(out) >= {"latency_ms", "ttft_ms", "tpot_ms", "throughput_tok_s", "memory_gib_per_device", "fits"}
    # FasterTransformer publishes 248 ms for this case (held out of the fit); within 25%
    assert out["latency_ms"] == pytest.approx(248, rel=0.25)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args, msg in ((["--model", str(cfg), "--hardware", "b200"], "unknown profile"),
                      (["--model", str(bad), "--hardware", "h200"], "not valid JSON"),
                      (["--model", str(cfg), "--hardware", "h200", "--tp", "5"], "not divisible by tp"),
                      (["--model", str(cfg), "--hardware", "h200", "--batch", "0"], "--batch")):
        run = CliRunner().invoke(app, ["tune", "predict", *args])
        assert run.exit_code == 2 and msg in run.output, run.output


def test_search_emits_valid_deployment_and_rejects_impossible_slo(tmp_path):
    from deploy.schema import load_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY.to_hf()))
    args = ["tune", "search", "--model", str(cfg), "--hardware", "a100-80gb", "--devices", "2", "--input-len", "16",
            "--output-len", "8", "--num-prompts", "20", "--out", str(tmp_path / "out"),
            "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]  # layouts x dtypes: 6 configs, not 24
    run = CliRunner().invoke(app, [*args, "--slo", "ttft_p99_ms=1000", "--slo", "tpot_ms=100"])
    assert run.exit_code == 0, run.output
    dep = load_config(tmp_path / "out" / "tuned.yaml")
    spec = dep.models[0]
    assert spec.world_size * spec.replicas <= 2
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["configs"]
    assert {r["weight_dtype"] for r in rows} == {"bfloat16", "fp8"}
    run = CliRunner().invoke(app, [*args, "--slo", "ttft_p99_ms=0.001"])
    assert run.exit_code == 2 and "no configuration meets the SLOs" in run.output, run.output
    run = CliRunner().invoke(app, [*args, "--slo", "latency_ms=5"])
    assert run.exit_code == 2 and "unknown SLO" in run.output, run.output


def test_emitted_yaml_serves(tmp_path, gpt2_dir):
    """The chosen config runs unchanged under `shardserve serve --config` (a short real run). The
    profile is a CPU one (cores set): a GPU profile's config asks for cuda and a GPU."""
    import os
    import shlex
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from proc_output import ProcOutput

    root = Path(__file__).resolve().parents[1]
    cpu = tmp_path / "cpu.yaml"
    load_profile("a100-80gb").replace(name="unit-cpu", cores=1).save(cpu)
    run = CliRunner().invoke(app, ["tune", "search", "--model", str(gpt2_dir / "config.json"), "--hardware",
                                   str(cpu), "--devices", "1", "--input-len", "16", "--output-len", "8",
                                   "--num-prompts", "20", "--weight-dtype", "float32", "--model-path", str(gpt2_dir),
                                   "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shardserve", "serve", "--config", str(tmp_path / "tuned.yaml"),
                             "--port", str(port)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    out = ProcOutput(proc)
    try:
        # three Ray starts on a loaded host fit (serving/launcher.py)
        curl = out.wait_line(lambda line: line.startswith("curl "), timeout=300)
        res = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0 and '"object":"text_completion"' in res.stdout, res.stdout + res.stderr
        proc.send_signal(signal.SIGINT)
        assert out.finish(timeout=120) == 0, out.text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_measured_profile_round_trips(tmp_path):
    """The measuring pieces of `tune profile` (small sizes; the one-shard and the TP2 layout through
    their real executors, two shard processes over gloo) give a profile that loads back unchanged
    and whose layout constants the cost model uses."""
    from tuner.measure import measure_bandwidth, measure_matmul, measure_width_factor
    from tuner.measure_engine import engine_steps, fit_layout
    from tuner.probe_model import gpt2_shape, write_random_checkpoint

    rates = measure_matmul((1,), rows=(4, 64))
    assert set(rates[1]) == {"float32", "bfloat16"} and all(v > 0 for v in rates[1]["float32"].values())
    width = measure_width_factor("float32", widths=(64,), rows=(4, 64))
    assert set(width) == {64, 768} and width[768] == {4: 1.0, 64: 1.0} and all(v > 0 for v in width[64].values())
    bw = measure_bandwidth(mib=64)
    base = HardwareProfile(name="unit-machine", kind="measured", memory_gib=8.0, hbm_bandwidth_gb_s=round(bw, 2),
                           flops_tflops={"float32": rates[1]["float32"][64]}, matmul_tflops=rates, cores=2,
                           matmul_width_factor=width, intra_node_bandwidth_gb_s=1.0, inter_node_bandwidth_gb_s=1.0,
                           bw_efficiency=1.0, flops_efficiency=1.0, collective_latency_us=50.0)
    cfg = gpt2_shape(2, 4, 64, 300, 256)
    ckpt = write_random_checkpoint(tmp_path / "probe", cfg)
    layouts = {}
    for tp in (1, 2):
        cost = CostModel(cfg, base, tp=tp, weight_dtype="float32")
        steps = [(w, dt, cost) for w, dt in engine_steps(ckpt, [(1, 8, 4), (4, 8, 3), (1, 100, 2)], "float32",
                                                         tp=tp, threads=1 if tp > 1 else 0, vocab=cfg.vocab_size)]
        assert len(steps) >= 5 and all(dt > 0 for _, dt, _ in steps)
        assert {w.tokens for w, _, _ in steps} >= {32, 1, 100}  # prefills of both sizes and decode steps
        layouts[f"{tp}x1"] = {k: v if isinstance(v, int) else float(f"{float(v):.6g}") for k, v in fit_layout(steps).items()}
    prof = base.replace(layouts=layouts)
    prof.save(tmp_path / "p.yaml")
    assert load_profile(str(tmp_path / "p.yaml")) == prof
    w = StepWork(tokens=1, sampled=1, decode_context=20)
    for tp in (1, 2):
        lay = prof.layout(tp, 1)
        assert lay is not None and lay["probe_steps"] >= 5
        parts = CostModel(cfg, prof, tp=tp, weight_dtype="float32").components(w)
        assert parts["step"] == pytest.approx(lay["step_overhead_ms"] * 1e-3)
        assert parts["layer"] == pytest.approx(2 * (lay["layer_overhead_us"] * 1e-6  # + per token-channel
                                                    + lay["token_layer_width_ns"] * 1e-9 * w.tokens * 64 / tp))


def test_fit_layout_recovers_known_constants():
    """Steps made by the layout formula from known constants fit back to those constants."""
    from tuner.measure_engine import fit_layout

    # depths, widths and vocabularies apart, as the profile's four probes
    models = [ModelConfig(model_type="gpt2", vocab_size=v, n_layer=n, n_head=4, n_embd=c, max_position_embeddings=512)
              for n, c, v in ((2, 128, 2048), (6, 256, 512), (4, 64, 8192), (8, 128, 1024))]
    prof = _profile(matmul_tflops={1: {"bfloat16": {1: 0.01, 64: 0.1}}, 2: {"bfloat16": {1: 0.02, 64: 0.2}}},
                    cores=2, collective_latency_us=100.0, cache_mib=4.0)  # the 6 x 256 probe's 9.4 MB outgrow it
    truth = {"step_overhead_ms": 2.0, "layer_overhead_us": 300.0, "seq_layer_overhead_us": 20.0, "seq_overhead_us": 50.0,
             "matmul_scale": 1.5, "comm_scale": 2.0, "attention_prefill_tflops": 0.05, "attention_kv_gb_s": 3.0,
             "vocab_seq_ns": 4.0, "token_layer_width_ns": 0.5, "dram_weight_gb_s": 7.0, "head_ns": 0.3,
             "prefill_step_ms": 1.5}
    works = [StepWork(tokens=b * n, sampled=b, prefill_attn_pairs=b * n * (n + 1) // 2)
             for b, n in ((1, 16), (4, 64), (1, 300), (8, 32), (2, 128))]
    works += [StepWork(tokens=b, sampled=b, decode_context=b * c) for b in (1, 8, 32) for c in (20, 200)]
    for tp, pp in ((2, 1), (1, 2)):
        steps = []
        for model in models:
            truth_cost = CostModel(model, prof.replace(layouts={f"{tp}x{pp}": truth}), tp=tp, pp=pp)
            steps += [(w, truth_cost.step_time(w), CostModel(model, prof, tp=tp, pp=pp)) for w in works]
        fit = fit_layout(steps)
        assert fit["probe_max_error_pct"] < 1e-3
        # the vocabulary's and the head's costs fixed (as the profile does for several shards): the
        # rest still fits, and the fixed columns come back as given, not as noise over their scale
        pinned = fit_layout(steps, vocab=truth["vocab_seq_ns"], head=truth["head_ns"])
        assert pinned["probe_max_error_pct"] < 1e-3
        assert pinned["vocab_seq_ns"] == pytest.approx(truth["vocab_seq_ns"])
        assert pinned["head_ns"] == pytest.approx(truth["head_ns"])
        # TP's all-reduce time is per layer plus per token-channel per layer plus the logits' per
        # vocabulary entry: exactly parts of three other terms, so only its sum with them is pinned,
        # which is all a prediction needs; a pipeline's sends are not, so every constant comes back
        unseen = ModelConfig(model_type="gpt2", vocab_size=1000, n_layer=8, n_head=4, n_embd=192,
                             max_position_embeddings=512)
        want = CostModel(unseen, prof.replace(layouts={f"{tp}x{pp}": truth}), tp=tp, pp=pp)
        got = CostModel(unseen, prof.replace(layouts={f"{tp}x{pp}": {k: v for k, v in fit.items()
                                                                     if k in {*truth, "matmul_mt_scale"}}}), tp=tp, pp=pp)
        for w in works:
            assert got.step_time(w) == pytest.approx(want.step_time(w), rel=1e-3)
        if tp == 1:
            for k, v in truth.items():
                assert fit[k] == pytest.approx(v, rel=1e-3), k


def test_weight_stream_bytes_past_the_cache():
    """Weights a step reads from memory: none while the copy fits the last-level cache, all of the
    critical path's from twice the cache on, linear in between; a TP shard reads its slice, the LM
    head only when the step samples; no term without cache_mib (devices, built-in profiles)."""
    model = ModelConfig(model_type="gpt2", vocab_size=1000, n_layer=4, n_head=4, n_embd=128, max_position_embeddings=64)
    prof = _profile(cores=2)
    layer = CostModel(model, prof).layer_params
    copy_b = (4 * layer + 1000 * 128) * 2  # bf16, tied embedding = the LM head
    path_b = copy_b  # one shard, sampling: every layer and the head
    w, w0 = StepWork(tokens=3, sampled=3), StepWork(tokens=64, sampled=0, prefill_attn_pairs=64 * 65 // 2)
    assert CostModel(model, prof).weight_stream_bytes(w) == 0.0
    for cache_b, miss in ((copy_b, 0.0), (copy_b / 1.5, 0.5), (copy_b / 2, 1.0), (copy_b / 10, 1.0)):
        p = prof.replace(cache_mib=cache_b / 2**20)
        assert CostModel(model, p).weight_stream_bytes(w) == pytest.approx(miss * path_b)
        assert CostModel(model, p, tp=2).weight_stream_bytes(w) == pytest.approx(miss * path_b / 2)
        assert CostModel(model, p, pp=2).weight_stream_bytes(w) == pytest.approx(miss * path_b)  # stages in turn
        assert CostModel(model, p).weight_stream_bytes(w0) == pytest.approx(miss * 4 * layer * 2)
    with pytest.raises(ProfileError, match="cache_mib"):
        prof.replace(cache_mib=-1.0)


def test_last_level_cache_from_sysfs(tmp_path):
    """The profile's cache size is the highest cache level sysfs lists (its K / M suffix read)."""
    from tuner.measure import last_level_cache_mib

    for i, (level, size) in enumerate(((1, "32K"), (2, "1024K"), (3, "32768K"), (3, "garbage"))):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{i}" / "size").write_text(f"{size}\n")
    assert last_level_cache_mib(tmp_path) == 32.0
    assert last_level_cache_mib(tmp_path / "absent") == 0.0


def test_probe_tokenizer_is_the_training_one(tmp_path):
    """The probe checkpoints' tokenizer is training.tokenizer's (BOS prepended): the validation
    replay adds what the engine adds to the load tester's prompt counts."""
    from tuner.probe_model import prompt_extra_tokens, write_tokenizer

    assert write_tokenizer(tmp_path, vocab_size=300) <= 300
    assert prompt_extra_tokens(tmp_path / "tokenizer.json") == 1
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == cfg["eos_token"] == "<|endoftext|>"


def test_an_fp8_candidate_is_emitted_as_the_engine_weight_dtype():
    """FP8 weights are an engine option (engine.weight_dtype: fp8, bf16 compute), which the emitted
    engine section carries into EngineConfig unchanged."""
    from engines import EngineConfig
    from tuner.emit import deployment
    from tuner.profiles import load_profile
    from tuner.search import Candidate

    dep = deployment(Candidate(1, 1, 1, 8, 512, "fp8"), "models/default", load_profile("h100-sxm"))
    engine = dep["models"][0]["engine"]
    assert engine["weight_dtype"] == "fp8" and engine["dtype"] == "bfloat16"
    assert EngineConfig(**engine).weight_dtype == "fp8"
    plain = deployment(Candidate(1, 1, 1, 8, 512, "bfloat16"), "models/default", load_profile("h100-sxm"))
    assert "weight_dtype" not in plain["models"][0]["engine"]


def test_served_steps_fit_back_to_known_constants():
    """Steps as GET /v1/admin/steps reports them, timed by a known layout plus a serving-loop gap
    of 1 ms + 0.2 ms per sampled sequence, on four probe shapes: step_cycles pairs each step with
    the gap after it (none when the engine idled), and fit_layout on those cycles gives back a cost
    model whose steps, for a model it did not see, take the known step + gap; request_overheads_s is
    the one-at-a-time TTFT beyond the prefill cycle."""
    from types import SimpleNamespace

    from tuner.measure_engine import fit_layout
    from tuner.measure_served import request_overheads_s, step_cycles

    prof = _profile(matmul_tflops={1: {"bfloat16": {1: 0.01, 64: 0.1}}, 2: {"bfloat16": {1: 0.02, 64: 0.2}}}, cores=2)
    lay = {"step_overhead_ms": 2.0, "layer_overhead_us": 300.0, "seq_layer_overhead_us": 20.0, "seq_overhead_us": 50.0,
           "matmul_scale": 1.5, "comm_scale": 1.0, "attention_prefill_tflops": 0.05, "attention_kv_gb_s": 0.3,
           "vocab_seq_ns": 2.0}
    truth_prof = prof.replace(layouts={"1x1": lay})

    def gap(w):
        return 1e-3 + 2e-4 * w.sampled

    def shape(n_layer, n_embd, vocab):
        return ModelConfig(model_type="gpt2", vocab_size=vocab, n_layer=n_layer, n_head=4, n_embd=n_embd,
                           max_position_embeddings=1024)

    rows = []
    for model in (shape(2, 64, 300), shape(8, 128, 50), shape(4, 32, 2000), shape(6, 64, 300)):
        truth, cost = CostModel(model, truth_prof), CostModel(model, prof)
        steps, end = [], 0.0
        for batch in (1, 2, 4, 8):
            for ctx in (20, 60, 110):
                w = StepWork(tokens=batch, sampled=batch, decode_context=batch * ctx, seqs=batch)
                p = StepWork(tokens=ctx, sampled=1, prefill_attn_pairs=ctx * (ctx + 1) // 2, seqs=1)
                for work, idle in ((p, True), (w, False), (w, False)):
                    g = None if idle else gap(steps[-1]["w"]) if steps else None
                    end += (g or 0.5) + truth.step_time(work)
                    steps.append({"w": work, "end_s": end, "seconds": truth.step_time(work), "gap_s": g,
                                  "decode_seqs": work.tokens if not work.prefill_attn_pairs else 0,
                                  "decode_context_tokens": work.decode_context, "prefill_seqs": int(bool(work.prefill_attn_pairs)),
                                  "prefill_tokens": work.tokens if work.prefill_attn_pairs else 0,
                                  "prefill_attention_pairs": work.prefill_attn_pairs, "sampled": work.sampled})
        cycles = step_cycles(steps)
        assert len(cycles) == len(steps) - 12  # the last of each group of three: an idle wait follows
        for (w, dt, g), s in zip(cycles, [s for s, n in itertools.pairwise(steps) if n["gap_s"] is not None],
                                 strict=True):
            assert w == s["w"] and dt == s["seconds"] and g == pytest.approx(gap(s["w"]))
        rows += [(w, dt + g, cost) for w, dt, g in cycles]
    fit = fit_layout(rows, threads=2, vocab=True)
    assert fit["probe_median_error_pct"] < 1.0
    unseen = shape(6, 96, 1000)
    fitted, truth = CostModel(unseen, prof.replace(layouts={"1x1": fit})), CostModel(unseen, truth_prof)
    for w in (StepWork(tokens=6, sampled=6, decode_context=6 * 80, seqs=6),
              StepWork(tokens=64, sampled=1, prefill_attn_pairs=64 * 65 // 2, seqs=1)):
        assert fitted.step_time(w) == pytest.approx(truth.step_time(w) + gap(w), rel=0.03)

    # one at a time: TTFT 40 ms, the prefill cycles 10 ms + 1.2 ms -> 28.8 ms of gateway
    recs = [SimpleNamespace(warmup=False, ok=True, output_tokens=3, requested_output_tokens=3, ttft_s=0.040,
                            tpot_s=0.01) for _ in range(3)]
    one = [{"end_s": 1.0 + i, "seconds": 0.010, "gap_s": None if i % 2 == 0 else 0.0012, "decode_seqs": i % 2,
            "decode_context_tokens": 20 * (i % 2), "prefill_seqs": 1 - i % 2, "prefill_tokens": 19 * (1 - i % 2),
            "prefill_attention_pairs": 190 * (1 - i % 2), "sampled": 1} for i in range(6)]
    assert request_overheads_s(SimpleNamespace(records=recs), one, (0.5, 7.0)) == pytest.approx([0.0288] * 3)


def test_prefill_step_cost_only_on_steps_with_a_prefill():
    """A layout's prefill_step_ms adds to a step that holds a prefill chunk, never to a decode-only
    step; a layout without it (older profiles) predicts as before."""
    model = ModelConfig(model_type="gpt2", vocab_size=1000, n_layer=4, n_head=4, n_embd=128, max_position_embeddings=64)
    lay = {"step_overhead_ms": 1.0, "layer_overhead_us": 10.0, "seq_overhead_us": 5.0, "seq_layer_overhead_us": 0.0,
           "matmul_scale": 1.0, "comm_scale": 1.0, "attention_prefill_tflops": 1.0, "attention_kv_gb_s": 10.0}
    old = _profile(cores=2).replace(layouts={"1x1": lay})
    new = old.replace(layouts={"1x1": {**lay, "prefill_step_ms": 2.5}})
    dec = StepWork(tokens=3, sampled=3, decode_context=60)
    pre = StepWork(tokens=19, sampled=2, prefill_attn_pairs=16 * 17 // 2, decode_context=20, seqs=4)
    assert CostModel(model, new).step_time(dec) == pytest.approx(CostModel(model, old).step_time(dec))
    assert CostModel(model, new).step_time(pre) == pytest.approx(CostModel(model, old).step_time(pre) + 2.5e-3)
    assert CostModel(model, new).components(pre)["step"] == pytest.approx(3.5e-3)


def test_prefill_layer_overhead_charges_prefill_steps_only():
    """An engine that replays CUDA graphs for decode but prefills eagerly (tuner/profiles/h200-shardserve.yaml)."""
    base = load_profile("h200")
    eager = base.replace(prefill_layer_overhead_us=400.0)
    model = ModelConfig(model_type="gpt2", vocab_size=1000, n_layer=6, n_head=4, n_embd=256)
    prefill = StepWork(tokens=32, sampled=1, prefill_attn_pairs=32 * 33 // 2)
    decode = StepWork(tokens=4, sampled=4, decode_context=4 * 40)
    a, b = CostModel(model, base), CostModel(model, eager)
    assert b.step_time(decode) == pytest.approx(a.step_time(decode))
    assert b.step_time(prefill) - a.step_time(prefill) == pytest.approx(6 * 400e-6)
    assert "h200-shardserve" in builtin_names() and load_profile("h200-shardserve").prefill_layer_overhead_us > 0
    with pytest.raises(ProfileError, match="prefill_layer_overhead_us"):
        base.replace(prefill_layer_overhead_us=-1.0)
