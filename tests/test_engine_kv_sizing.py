"""KV cache sized from free memory: the budget is respected, and an explicit budget still wins."""

from __future__ import annotations

import pytest
import torch

from engines import LLM, SamplingParams
from engines.core.config import ConfigError, EngineConfig, kv_bytes_per_block, num_kv_blocks
from engines.core.kv_sizing import activation_reserve_bytes, kv_cache_budget

GiB = 2**30


def test_fraction_budget_respects_free_memory(gpt2_dir):
    from engines.core.config import ModelConfig

    cfg = ModelConfig.from_dir(gpt2_dir)
    eng = EngineConfig(kv_cache_memory_fraction=0.5)
    cpu = torch.device("cpu")
    # 8 GiB device, 3 GiB used by others and the weights: the engine may hold 4 GiB -> 1 GiB left
    budget = kv_cache_budget(cfg, eng, cpu, free_total=(5 * GiB, 8 * GiB))
    assert budget == 4 * GiB - 3 * GiB - activation_reserve_bytes(cfg, eng)
    blocks = num_kv_blocks(cfg, eng, budget)
    assert 0 < blocks * kv_bytes_per_block(cfg, eng) <= budget
    assert kv_cache_budget(cfg, eng.replace(kv_cache_memory_fraction=0.9), cpu,
                           free_total=(5 * GiB, 8 * GiB)) > budget
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
        kv_cache_budget(cfg, eng, cpu, free_total=(3 * GiB, 8 * GiB))
    # an explicit byte budget is taken as given
    assert kv_cache_budget(cfg, eng.replace(kv_cache_bytes=123 * 2**20), cpu) == 123 * 2**20


def test_engine_sizes_cache_from_host_memory(gpt2_dir):
    llm = LLM(gpt2_dir, kv_cache_memory_fraction=0.05, cpu_linear_autotune=False)
    runner = llm.engine.executor.runner
    from engines.core.kv_sizing import host_available_bytes

    assert 0 < runner.cache.nbytes <= 0.05 * host_available_bytes() + runner.cache.nbytes * 0.5
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    small = LLM(gpt2_dir, kv_cache_bytes=2**20, cpu_linear_autotune=False).engine.executor.runner
    assert small.cache.nbytes <= 2**20


@pytest.mark.parametrize("bad", [-1, 0.0, 1.5, "x"])
def test_fraction_validated(bad):
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=bad)
