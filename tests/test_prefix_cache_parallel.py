"""Prefix caching with tensor- and pipeline-parallel shards (multiprocess executor, gloo): the block
tables the driver's scheduler hands out, shared blocks included, give every shard the same cache
layout, so outputs equal a single-device run without caching, also under preemption."""

from __future__ import annotations

import pytest
from parallel_fixtures import LogitsRecorder
from test_prefix_cache import BS, QUESTIONS, SYS, chat_schedule, params, run

from engines.core.config import EngineConfig
from engines.core.executor import InProcessExecutor
from engines.core.llm_engine import LLMEngine
from engines.parallel.mp_executor import MultiprocExecutor

BASE = EngineConfig(num_kv_blocks=64, block_size=BS, max_num_batched_tokens=64, worker_threads=1, dist_timeout_s=60)
TIGHT = [(f"p{i}", SYS[:22] + q, params("greedy", i)) for i, q in enumerate(QUESTIONS[:5])]


def _run(model_dir, executor, cfg: EngineConfig, schedule) -> tuple[dict, LLMEngine]:
    eng = LLMEngine(model_dir, cfg, executor_factory=lambda d, c: executor)
    return {r: o.outputs[0].token_ids for r, o in run(eng, schedule).items()}, eng


@pytest.fixture(scope="module")
def reference(gpt2_dir):
    off = BASE.replace(enable_prefix_caching=False)
    ex = InProcessExecutor(gpt2_dir, off)
    return {"chat": _run(gpt2_dir, ex, off, chat_schedule("seeded"))[0],
            "tight": _run(gpt2_dir, ex, off, {0: TIGHT[:3], 3: TIGHT[3:]})[0]}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_shards_with_prefix_caching(gpt2_dir, reference, tp, pp):
    ex = MultiprocExecutor(gpt2_dir, BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                  pipeline_microbatches=2 if pp > 1 else 0))
    try:
        outs, eng = _run(gpt2_dir, ex, BASE, chat_schedule("seeded"))
        assert outs == reference["chat"] and eng.stats()["prefix_cache_hits"] > 0
        if pp == 1:
            return  # preemption is the driver's alone: once, under the pipeline's micro-batches, is enough
        # the scheduler sees 12 blocks (the shards have more; only the ids it hands out are used)
        tight = BASE.replace(num_kv_blocks=12, admission_reserves_growth=False, max_num_seqs=4)
        outs, eng = _run(gpt2_dir, LogitsRecorder(ex, num_blocks=12), tight, {0: TIGHT[:3], 3: TIGHT[3:]})
        assert outs == reference["tight"]
        assert eng.scheduler.num_preemptions > 0 and eng.stats()["prefix_cache_hits"] > 0
    finally:
        ex.shutdown()
