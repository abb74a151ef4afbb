"""The static-shape decode path (engines/runner/decode_runner.py) against the eager path, on CPU."""

from __future__ import annotations

import pytest
import torch
from staggered import run_staggered
from torch.utils._python_dispatch import TorchDispatchMode

from engines import EngineConfig, SamplingParams
from engines.core.llm_engine import LLMEngine
from engines.core.plan import SeqWork
from engines.runner.decode_runner import context_buckets, pick_bucket

GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 6, 14, 9, 17, 3)]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7 + i, max_tokens=n, ignore_eos=True)
          for i, n in enumerate((20, 6, 14, 9, 17, 3))]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_padded_path_equals_eager_through_joins_leaves_and_preemption(gpt2_dir, params):
    base = {"num_kv_blocks": 14, "block_size": 4, "admission_reserves_growth": False, "cpu_linear_autotune": False}
    eager = LLMEngine(gpt2_dir, EngineConfig(static_decode="off", **base))
    expect = run_staggered(eager, params)
    static = LLMEngine(gpt2_dir, EngineConfig(static_decode="on", **base))
    runner = static.executor.runner
    used = []
    real_run = runner.decode_runner.run
    runner.decode_runner.run = lambda decode: used.append(len(decode)) or real_run(decode)
    got = run_staggered(static, params)
    assert got == expect
    assert used and max(used) > 1, "the padded path never ran a batch"
    assert static.scheduler.num_preemptions > 0 and eager.scheduler.num_preemptions > 0
    assert runner.num_blocks == 13  # one block of the 14 is the null block of padded rows


def test_bucket_choice_and_fallback(gpt2_dir):
    assert [pick_bucket((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    engine = LLMEngine(gpt2_dir, EngineConfig(static_decode="on", max_num_seqs=8, cpu_linear_autotune=False))
    dr = engine.executor.runner.decode_runner
    dr.buckets = (1, 2)  # batches of 3+ must fall back to the eager path
    sizes = []
    real_run = dr.run
    dr.run = lambda decode: sizes.append(len(decode)) or real_run(decode)
    expect = run_staggered(LLMEngine(gpt2_dir, EngineConfig(static_decode="off", cpu_linear_autotune=False)), GREEDY)
    assert run_staggered(engine, GREEDY) == expect
    assert sizes and max(sizes) <= 2


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_sync_inside_the_step(gpt2_dir):
    engine = LLMEngine(gpt2_dir, EngineConfig(static_decode="on", block_size=4, cpu_linear_autotune=False))
    dr = engine.executor.runner.decode_runner
    work = [SeqWork(seq_id=i, token_ids=[5 + i], start_pos=6 + i, block_ids=[2 * i, 2 * i + 1],
                    sample=True) for i in range(3)]
    B = dr.bucket_for(work)
    assert B == 4
    dr._fill(work, B, dr.max_blocks)
    with torch.inference_mode(), _OpLog() as log:
        hidden = dr._step(B)
    assert hidden.shape[0] == 4 and any("aten.index" in op for op in log.ops)  # the trace sees the step
    syncs = [op for op in log.ops if any(s in op for s in ("_local_scalar_dense", "item", "nonzero", "masked_select",
                                                           "unique", "repeat_interleave"))]
    assert not syncs, f"host syncs inside the decode step: {syncs}"


def test_context_buckets_read_only_what_the_rows_hold(gpt2_dir):
    assert context_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert context_buckets(5) == (1, 2, 4, 5) and context_buckets(1) == (1,)
    engine = LLMEngine(gpt2_dir, EngineConfig(static_decode="on", block_size=4, num_kv_blocks=40,
                                              cpu_linear_autotune=False))
    dr = engine.executor.runner.decode_runner
    assert dr.max_blocks == 64  # 256 positions / 4
    g = torch.Generator().manual_seed(0)
    for layer in dr.cache.data:  # a cache full of random keys and values
        layer.copy_(torch.randn(layer.shape, generator=g))
    # rows of 1, 3 and 6 blocks: the step reads 8 columns of the table (bucket of 6)
    work = [SeqWork(seq_id=i, token_ids=[5 + i], start_pos=4 * n - 2, block_ids=list(range(12 * i, 12 * i + n)),
                    sample=True) for i, n in enumerate((1, 3, 6))]
    assert dr.context_bucket(work) == 8
    B = dr.bucket_for(work)
    with torch.inference_mode():
        dr._fill(work, B, dr.max_blocks)
        whole = dr._step(B).clone()  # every column of the table
        dr._fill(work, B, dr.max_blocks)  # the same keys and values written again: the same inputs
        part = dr._step(B, 8)
        dr._fill(work, B, dr.max_blocks)
        short = dr._step(B, 4)  # too few columns: the 6-block row loses context
    torch.testing.assert_close(part[:3], whole[:3], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(short[2], whole[2], atol=1e-3)  # the check can fail
