"""The GPU decode path's host-side parts, checked on CPU: the block-table fill, the capture plan, KV
sizing after FP8 conversion, GQA decode attention without repeated K/V, and the FP8 kernel choice.
What only a GPU shows (graph replay speed, the kernels' timings) is in benchmarks/bench_gpu.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.core.config import EngineConfig, ModelConfig
from engines.core.kv_sizing import kv_cache_budget
from engines.core.llm_engine import LLMEngine
from engines.core.plan import SeqWork
from engines.runner.decode_runner import StaticDecodeBackend, capture_plan
from engines.transforms.fp8 import Fp8Linear, ScaledMMLinear
from engines.transforms.fp8_choice import Fp8ByRows, TensorwiseScaledMMLinear, pick, quantize_tensor, row_slot
from engines.transforms.fp8_format import dequantize


def test_fill_writes_only_the_columns_the_step_reads(gpt2_dir):
    engine = LLMEngine(gpt2_dir, EngineConfig(static_decode="on", block_size=4, num_kv_blocks=40,
                                              cpu_linear_autotune=False))
    dr = engine.executor.runner.decode_runner
    assert dr.max_blocks == 64
    dr.table.fill_(-7)  # a sentinel: columns the fill must not touch keep it
    work = [SeqWork(seq_id=i, token_ids=[5], start_pos=4 * n - 1, block_ids=list(range(10 * i, 10 * i + n)),
                    sample=True) for i, n in enumerate((1, 3))]
    B = dr.bucket_for(work)
    ncols = dr.context_bucket(work)
    assert (B, ncols) == (2, 4)
    dr._fill(work, B, ncols)
    assert dr.table[0, :4].tolist() == [0, dr.null_block, dr.null_block, dr.null_block]
    assert dr.table[1, :4].tolist() == [10, 11, 12, dr.null_block]
    assert (dr.table[:, 4:] == -7).all(), "the fill wrote columns the step does not read"
    assert dr.slots[:2].tolist() == [0 * 4 + 3, 12 * 4 + 3]  # each row's new position's slot
    assert dr.lens[:2].tolist() == [4, 12]


def test_capture_plan_covers_every_batch_first_and_keeps_the_budget():
    plan = capture_plan((1, 2, 4), (2, 4, 8), est_s=0.0, budget_s=30.0)
    assert plan[:3] == [(1, 8), (2, 8), (4, 8)]  # any step has a graph wide enough
    assert plan[3:6] == [(1, 2), (2, 2), (4, 2)]  # then the short contexts
    assert len(plan) == 9 and len(set(plan)) == 9
    assert capture_plan((1, 2, 4), (2, 4, 8), est_s=0.5, budget_s=2.2) == plan[:4]
    assert capture_plan((1, 2), (16,), est_s=100.0, budget_s=30.0) == []


def test_kv_budget_measures_after_freed_memory_is_returned(monkeypatch):
    """FP8 conversion frees the bf16 weights into the caching allocator; the budget must count them."""
    gib = 2**30
    state = {"free": 10 * gib, "cached_unused": 4 * gib, "calls": []}

    def empty_cache():
        state["calls"].append("empty_cache")
        state["free"] += state["cached_unused"]
        state["cached_unused"] = 0

    def mem_get_info(device=None):
        state["calls"].append("mem_get_info")
        return state["free"], 80 * gib

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    model = ModelConfig(model_type="llama", vocab_size=1000, n_layer=2, n_head=4, n_embd=64, intermediate_size=128,
                        n_kv_head=2, bias=False, activation="silu", tie_word_embeddings=False)
    engine = EngineConfig(kv_cache_memory_fraction=0.9)
    from engines.core.kv_sizing import activation_reserve_bytes

    budget = kv_cache_budget(model, engine, torch.device("cuda"))
    assert state["calls"] == ["empty_cache", "mem_get_info"]
    assert budget == int(0.9 * 80 * gib) - (80 - 14) * gib - activation_reserve_bytes(model, engine)


def test_gqa_decode_attention_equals_repeated_kv_reference():
    torch.manual_seed(0)
    B, nh, nkv, hd, bs, nblocks = 3, 8, 2, 16, 4, 16

    class Cache:
        data = torch.randn(1, 2, nblocks * bs, nkv, hd)

    q, k, v = torch.randn(B, nh, hd), torch.randn(B, nkv, hd), torch.randn(B, nkv, hd)
    lens = torch.tensor([5, 9, 1])
    slots = torch.tensor([4, 4 + 8 + 4, 40])  # where each row's new key goes
    index = torch.stack([torch.arange(0, 12), torch.arange(8, 20), torch.arange(40, 52)])  # (B, L)
    mask = (torch.arange(12)[None, :] < lens[:, None]).view(B, 1, 1, -1)
    expect_cache = Cache.data.clone()
    y = StaticDecodeBackend(Cache, slots, index, mask)(0, q, k, v)
    expect_cache[0, 0, slots], expect_cache[0, 1, slots] = k, v
    torch.testing.assert_close(Cache.data, expect_cache)
    ks = expect_cache[0, 0][index].transpose(1, 2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, L, hd)
    vs = expect_cache[0, 1][index].transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    ref = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, attn_mask=mask)[:, :, 0]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_fp8_kernel_plan_is_the_fastest_per_row_count_and_never_a_failed_one():
    """A variant per timed row count; bf16 (a second copy of the weight) only for all of them, when its total is
    no more than the FP8 plan's; a variant that failed anywhere is out."""
    assert pick({"rowwise": [3.0, 3.0], "tensorwise": [1.0, 1.5], "bf16": [2.0, 2.0]}) == ("tensorwise",) * 2
    assert pick({"wo-n32-sk4": [1.0, 2.0, 9.0], "tensorwise": [3.0, 2.5, 4.0], "bf16": [2.0, 3.0, 4.5]}) == (
        "wo-n32-sk4", "wo-n32-sk4", "tensorwise")  # 1 + 2 + 4 against bf16's 9.5
    assert pick({"wo-n32": [1.0, 2.0, 9.0], "tensorwise": [3.0, 2.5, 6.6], "bf16": [2.0, 3.0, 4.5]}) == ("bf16",) * 3
    assert pick({"rowwise": [3.0], "tensorwise": [None], "bf16": [2.0]}) == ("bf16",)
    assert pick({"rowwise": [1.0, 1.0], "tensorwise": [0.5, None], "bf16": [5.0, 5.0]}) == ("rowwise",) * 2
    assert pick({"rowwise": [1.0], "tensorwise": [1.0], "bf16": [1.0]}) == ("bf16",)  # ties keep bf16
    assert pick({"rowwise": [None], "tensorwise": [None], "bf16": [None]}) == ("bf16",)


def test_fp8_by_rows_runs_the_variant_of_the_nearest_timed_row_count():
    torch.manual_seed(0)
    src = Fp8Linear.quantize(torch.nn.Linear(64, 48, bias=True))
    variants = {"tensorwise": TensorwiseScaledMMLinear(src), "rowwise": ScaledMMLinear(src)}
    layer = Fp8ByRows(variants, ("tensorwise", "tensorwise", "rowwise"), (1, 8, 64))
    assert [row_slot(m, (1, 8, 64)) for m in (1, 2, 3, 22, 23, 64, 500)] == [0, 0, 1, 1, 2, 2, 2]
    for shape, kind in (((1, 64), "tensorwise"), ((2, 11, 64), "tensorwise"), ((4, 16, 64), "rowwise")):
        x = torch.randn(*shape)
        assert torch.equal(layer(x), variants[kind](x)), (shape, kind)
    assert variants["tensorwise"].weight is variants["rowwise"].weight is src.weight  # one e4m3 copy
    x = torch.randn(4, 16, 64)  # a compiled decode step (fullgraph) traces the choice: once per row count
    with torch.inference_mode():
        assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), variants["rowwise"](x))


def test_tensorwise_fp8_equals_dequantize_then_matmul():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    src = Fp8Linear.quantize(lin)
    layer = TensorwiseScaledMMLinear(src)
    x = torch.randn(2, 3, 64)
    y = layer(x)  # CPU _scaled_mm with scalar scales, per-channel weight scale after the product
    xq, xs = quantize_tensor(x.reshape(-1, 64))
    assert xs.dim() == 0 and xq.dtype == torch.float8_e4m3fn
    ref = (xq.float() * xs) @ dequantize(src.weight, src.weight_scale, torch.float32).t() + lin.bias
    torch.testing.assert_close(y, ref.view(2, 3, 48), rtol=1e-4, atol=1e-4)
    full = x @ dequantize(src.weight, src.weight_scale, torch.float32).t() + lin.bias
    assert (y - full).norm() / full.norm() < 0.06  # only the activation's e4m3 rounding remains
