"""compile_decode: the inductor-compiled static decode step (engines/runner/compiled.py) against eager, on CPU.

Tiny models, two graphs per engine; the compiled code goes to a per-session cache directory."""

from __future__ import annotations

import logging

import pytest
import torch
from staggered import run_staggered

from engines import EngineConfig
from engines.core.config import ConfigError
from engines.core.llm_engine import LLMEngine
from engines.runner import compiled as compiled_mod
from engines.runner.compiled import CompileUnavailable, cpp_compiler, resolve_compile
from tests.test_engine_decode_runner import GREEDY, SEEDED

needs_cxx = pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler: inductor cannot build CPU kernels")


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))


@needs_cxx
def test_compiled_equals_eager_through_joins_leaves_and_preemption(llama_dir):
    """Greedy and seeded tokens identical to the eager path (fp32; the compiled attention sums in a
    different order than SDPA, ~1e-6 apart, which these tiny random models never turn into another
    argmax), with batches of 1-3 (buckets 1, 2, 4) that join, leave and are preempted; the engine's
    warm-up compiled every graph, so no step compiles another. The Llama family (RoPE, RMSNorm, GQA,
    SwiGLU: what the real models run); a GPT-2 variant cost 140 s of a 2-core CI run for the same
    compile path (the families differ only in modules both the eager and the fused paths test)."""
    import torch._dynamo.utils as dutils

    path = llama_dir
    base = {"num_kv_blocks": 20, "block_size": 4, "admission_reserves_growth": False, "cpu_linear_autotune": False,
            "dtype": "float32", "max_num_seqs": 64}
    expect = [run_staggered(LLMEngine(path, EngineConfig(static_decode="off", **base)), p) for p in (GREEDY, SEEDED)]
    engine = LLMEngine(path, EngineConfig(compile_decode="on", **base))
    runner = engine.executor.runner
    dr = runner.decode_runner
    assert dr is not None and dr.compiled is not None and runner.compile_s > 0
    sizes, rows = [], []
    real_run, real_fn = dr.run, dr.compiled.fn
    dr.run = lambda decode: sizes.append(len(decode)) or real_run(decode)
    dr.compiled.fn = lambda *a: rows.append(a[1].shape[0]) or real_fn(*a)
    dutils.counters.clear()
    assert [run_staggered(engine, p) for p in (GREEDY, SEEDED)] == expect
    assert not dutils.counters["stats"].get("unique_graphs"), dict(dutils.counters["stats"])  # warmed up
    assert engine.scheduler.num_preemptions > 0
    assert {1, 2, 3} <= set(sizes), f"the compiled step ran batches {sorted(set(sizes))}, not 1, 2 and 3"
    assert len(rows) == len(sizes) and 1 in rows  # batch 1 runs its own graph


def test_option_is_validated_with_the_field_name():
    with pytest.raises(ConfigError, match="compile_decode: must be auto, on or off"):
        EngineConfig(compile_decode="yes")
    with pytest.raises(ConfigError, match="compile_decode: 'on' .* static_decode is 'off'"):
        EngineConfig(compile_decode="on", static_decode="off")
    with pytest.raises(ConfigError, match="compile_decode: 'on' .* a tensor-parallel shard all-reduces"):
        EngineConfig(compile_decode="on", tensor_parallel_size=2)
    EngineConfig(compile_decode="on", pipeline_parallel_size=2)  # a pipeline stage compiles its layers


def test_no_compiler_auto_warns_and_runs_eager_on_fails(gpt2_dir, monkeypatch, caplog):
    monkeypatch.setattr(compiled_mod, "cpp_compiler", lambda: None)
    with pytest.raises(CompileUnavailable, match="compile_decode: 'on' but no C\\+\\+ compiler"):
        LLMEngine(gpt2_dir, EngineConfig(compile_decode="on", cpu_linear_autotune=False))
    with caplog.at_level(logging.WARNING, logger="engines.runner.compiled"):
        engine = LLMEngine(gpt2_dir, EngineConfig(compile_decode="auto", cpu_linear_autotune=False))
    assert engine.executor.runner.decode_runner is None  # eager decode
    assert any("no C++ compiler" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert run_staggered(engine, GREEDY)  # and it serves


def test_inductor_failure_under_on_is_an_error(gpt2_dir, monkeypatch, tmp_path):
    """A compiler that exists but fails (here: /bin/false as the C++ compiler, nothing cached) fails
    the load under "on"."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, "/bin/false"))
    with pytest.raises(CompileUnavailable, match="inductor failed"):
        LLMEngine(gpt2_dir, EngineConfig(compile_decode="on", cpu_linear_autotune=False, num_kv_blocks=8))


def test_resolve_compile_by_device():
    assert resolve_compile("off", torch.device("cpu"))[0] is False
    assert resolve_compile("auto", torch.device("cuda"))[0] is False
    on, why = resolve_compile("on", torch.device("cuda"))  # Triton kernels captured in CUDA graphs
    assert on and "CUDA graphs" in why
    with pytest.raises(CompileUnavailable, match="CPU and CUDA"):
        resolve_compile("on", torch.device("mps"))
