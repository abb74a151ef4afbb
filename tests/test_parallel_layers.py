"""Model parallelism on one CPU, no process group: config checks, the sharding plan on the meta
device, the sharded loader against the in-memory transform, and TP shards as threads of one
process giving the single-device tokens and logits."""

from __future__ import annotations

import copy
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from parallel_fixtures import (
    PROMPTS,
    LogitsRecorder,
    ThreadComm,
    ThreadGroup,
    ThreadTPExecutor,
    make_own_checkpoint,
    max_logit_error,
    run_engine,
)

from engines.core.config import ConfigError, EngineConfig, ModelConfig
from engines.core.executor import InProcessExecutor
from engines.core.plan import SeqInit, SeqWork, StepPlan
from engines.core.sampling_params import SamplingParams
from engines.loading.checkpoint import load_model
from engines.parallel import check_parallel_config, make_executor_factory
from engines.parallel.comm import LocalComm
from engines.parallel.layout import ParallelLayout, stage_layer_ranges
from engines.parallel.pp import ideal_bubble, measured_bubble, split_microbatches, split_stage
from engines.parallel.sharded_loading import expected_shard_bytes, load_shard, meta_device, shard_bytes
from engines.parallel.tp import apply_tp
from engines.runner.sampler import Sampler
from engines.runner.step_head import StepHead

MEDIUM = ModelConfig(model_type="gpt2", vocab_size=50257, n_layer=24, n_head=16, n_embd=1024)
GQA = ModelConfig(model_type="llama", vocab_size=1000, n_layer=3, n_head=8, n_embd=64, n_kv_head=2,
                  intermediate_size=96, tie_word_embeddings=False, bias=False, activation="silu")


def fake_comm(tp: int, rank: int) -> LocalComm:
    comm = LocalComm()  # shapes only: no collective is called
    comm.tp_size, comm.tp_rank = tp, rank
    return comm


# configuration errors
@pytest.mark.parametrize("cfg, tp, pp, match", [
    (MEDIUM, 3, 1, r"tensor_parallel_size: .*16 attention heads .*tensor_parallel_size=3; allowed: \[1, 2, 4, 8, 16\]"),
    (GQA.replace(n_head=6, n_kv_head=2, n_embd=60, intermediate_size=96), 3, 1, "2 key/value heads"),
    (GQA.replace(intermediate_size=90), 4, 1, "MLP width 90"),
    (GQA, 1, 4, r"pipeline_parallel_size: the model has 3 layers, fewer than pipeline_parallel_size=4"),
    (GQA, 0, 1, "tensor_parallel_size: must be an integer >= 1"),
])
def test_config_errors_name_the_field(cfg, tp, pp, match):
    with pytest.raises(ConfigError, match=match):
        check_parallel_config(cfg, tp, pp)


def test_engine_config_fields_are_validated():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=-1)
    with pytest.raises(ConfigError, match="pipeline_microbatches"):
        EngineConfig(pipeline_microbatches=-1)
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_executor_rejects_bad_layout_before_spawning(gpt2_dir):
    from engines.parallel.mp_executor import MultiprocExecutor

    with pytest.raises(ConfigError, match="pipeline_parallel_size: the model has 2 layers"):
        MultiprocExecutor(gpt2_dir, EngineConfig(pipeline_parallel_size=3))
    with pytest.raises(ConfigError, match="4 attention heads are not divisible by tensor_parallel_size=3"):
        MultiprocExecutor(gpt2_dir, EngineConfig(tensor_parallel_size=3))
    assert make_executor_factory(EngineConfig()) is InProcessExecutor
    assert make_executor_factory(EngineConfig(tensor_parallel_size=2)) is MultiprocExecutor


# layout
def test_stage_ranges_are_contiguous_and_balance_the_head():
    for pp in (1, 2, 3, 4, 24):
        ranges = stage_layer_ranges(MEDIUM, pp)
        assert ranges[0][0] == 0 and ranges[-1][1] == 24 and len(ranges) == pp
        assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in itertools.pairwise(ranges))
    # GPT-2 medium's head costs ~4 layers: the last of two stages takes fewer layers
    assert stage_layer_ranges(MEDIUM, 2) == ((0, 14), (14, 24))
    assert stage_layer_ranges(GQA, 3) == ((0, 1), (1, 2), (2, 3))


def work(seq_id, n):
    return SeqWork(seq_id=seq_id, token_ids=[1] * n, start_pos=0 if n > 1 else 5, block_ids=[seq_id], sample=True)


def test_microbatches_are_contiguous_and_balanced():
    works = [work(i, 1) for i in range(16)]
    assert split_microbatches(works, 2) == [list(range(8)), list(range(8, 16))]
    assert [len(g) for g in split_microbatches(works, 4)] == [4, 4, 4, 4]
    assert split_microbatches(works[:3], 8) == [[0], [1], [2]]
    mixed = [work(0, 1), work(1, 1), work(2, 30), work(3, 2)]
    groups = split_microbatches(mixed, 2)
    assert [i for g in groups for i in g] == [0, 1, 2, 3] and len(groups) == 2
    # auto micro-batching splits only steps whose micro-batches stay compute-bound
    layout = ParallelLayout.build(GQA, 1, 2)
    assert layout.microbatches(EngineConfig(), 16) == 1 and layout.microbatches(EngineConfig(), 512) == 2
    assert layout.microbatches(EngineConfig(pipeline_microbatches=4), 16) == 4
    assert ParallelLayout.build(GQA, 2, 1).microbatches(EngineConfig(pipeline_microbatches=4), 512) == 1
    assert ideal_bubble(2, 1) == 0.5 and ideal_bubble(2, 2) == pytest.approx(1 / 3)
    assert measured_bubble([(0.0, 1.0, 1.0), (0.0, 1.0, 0.5)]) == pytest.approx(0.25)


# the sharding plan, on the meta device with a faked world size (litgpt style)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_shapes_on_meta(tp):
    from engines.model.transformer import GPT

    for cfg in (MEDIUM, GQA, GQA.replace(n_kv_head=1)):
        with meta_device():
            stage = apply_tp(split_stage(GPT(cfg), 0, cfg.n_layer), cfg, fake_comm(tp, tp - 1))
        blk = stage.blocks["0"]
        kv_local = max(1, cfg.kv_heads // tp)
        assert blk.attn.qkv.weight.shape == ((cfg.n_head // tp + 2 * kv_local) * cfg.hd, cfg.n_embd)
        assert blk.attn.proj.weight.shape == (cfg.n_embd, cfg.n_head // tp * cfg.hd)
        up_rows = cfg.ffn_dim // tp * (2 if cfg.activation == "silu" else 1)
        assert blk.mlp.up.weight.shape == (up_rows, cfg.n_embd)
        assert blk.mlp.down.weight.shape == (cfg.n_embd, cfg.ffn_dim // tp)
        vp = -(-cfg.vocab_size // tp)
        assert stage.wte.weight.shape == (vp, cfg.n_embd) and stage.lm_head.weight.shape == (vp, cfg.n_embd)
        assert (stage.lm_head.weight is stage.wte.weight) == cfg.tie_word_embeddings
        # every rank holds 1/tp of the big matrices; norms, positions and row biases are replicated
        full = expected_shard_bytes(cfg, 1, 0, cfg.n_layer)
        assert expected_shard_bytes(cfg, tp, 0, cfg.n_layer) < full / tp * 1.1


# the sharded loader reads exactly what the transform cuts from the full model
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_sharded_loader_matches_transform(model_dir, tp, pp):
    model, cfg = load_model(model_dir)
    layout = ParallelLayout.build(cfg, tp, pp)
    for rank in range(layout.world_size):
        t, s = layout.coords(rank)
        a, b = layout.stages[s]
        ref = apply_tp(split_stage(copy.deepcopy(model), a, b), cfg, fake_comm(tp, t)).state_dict()
        shard = load_shard(model_dir, cfg, a, b, fake_comm(tp, t))
        got = shard.state_dict()
        assert ref.keys() == got.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
        # memory per rank: 1/(tp x pp) of the weights plus the replicated parts, and nothing more
        assert shard_bytes(shard) == expected_shard_bytes(cfg, tp, a, b)


# tensor parallel end to end, ranks as threads
@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    return make_own_checkpoint(tmp_path_factory.mktemp("mqa"), model_type="llama", vocab_size=397, n_layer=2,
                               n_head=4, n_embd=64, n_kv_head=1, intermediate_size=128,
                               tie_word_embeddings=False, bias=False, activation="silu")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["gpt2", "llama", "mqa"])
def test_tp_threads_match_single_device(which, tp, gpt2_dir, llama_dir, mqa_dir):
    """GQA heads split (llama: 2 KV heads over 2 ranks) or replicated (4 ranks; MQA)."""
    d = {"gpt2": gpt2_dir, "llama": llama_dir, "mqa": mqa_dir}[which]
    cfg = EngineConfig(num_kv_blocks=64)
    ref, _ = run_engine(d, InProcessExecutor(d, cfg), cfg)
    rec = LogitsRecorder(ThreadTPExecutor(d, cfg.replace(tensor_parallel_size=tp)))
    outs, _ = run_engine(d, rec, cfg)
    assert outs == ref
    assert max_logit_error(d, PROMPTS, outs, rec.logits) < 1e-4


def test_tp_threads_sampling_paths(llama_dir):
    """Seeded sampling, logprobs and prompt logprobs go through the gathered-logits path."""
    cfg = EngineConfig(num_kv_blocks=64)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1) for i in range(len(PROMPTS))]
    ref, _ = run_engine(llama_dir, InProcessExecutor(llama_dir, cfg), cfg, params=params)
    outs, _ = run_engine(llama_dir, ThreadTPExecutor(llama_dir, cfg.replace(tensor_parallel_size=2)), cfg,
                         params=params)
    assert outs == ref


@pytest.mark.parametrize("tp", [2, 3])
def test_combined_argmax_rules_out_min_tokens_ids_and_the_padded_tail(tp):
    """The TP greedy argmax from vocabulary shards (two numbers a row, two more a row with min_tokens) equals the
    argmax of the full row with the row's suppressed ids masked: EOS and stop ids while it is short of min_tokens,
    none after; ties to the lowest id within a shard and across shards; the last shard's zero padding (a logit of 0
    above every real one here) is no token."""
    V = 11
    per = -(-V // tp)
    full = -1 - torch.rand(6, V, generator=torch.Generator().manual_seed(tp))  # below the padding's zeros
    full[1, 2] = 5.0  # EOS (2) on top of a row short of min_tokens
    full[2, 7] = 5.0  # a stop id on top of a row that has its min_tokens: kept
    full[3, 9], full[3, 4], full[3, 8] = 5.0, 3.0, 3.0  # a stop id on top, the next tied across shards
    full[4, 0], full[4, V - 1] = 5.0, 4.0  # a stop id in the first shard, the next best in the last
    full[5, 2], full[5, 3], full[5, 5] = 4.0, 2.0, 2.0  # EOS on top, the next tied inside one shard
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[9]),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=1, stop_token_ids=[0]),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=5)]
    inits = [SeqInit(i, 0, p, [1], (2,)) for i, p in enumerate(params)]
    group = ThreadGroup(tp)
    heads = [StepHead(None, ThreadComm(group, r), Sampler(V, 0, torch.device("cpu")) if r == 0 else None, V, r)
             for r in range(tp)]
    for h in heads:
        h.update(StepPlan(0, new_seqs=inits))
    states = heads[0].sampler.states
    for i, n in enumerate([0, 0, 3, 1, 0, 0]):
        states[i].num_output = n
    padded = torch.cat([full, torch.zeros(6, tp * per - V)], 1)
    with ThreadPoolExecutor(tp) as pool:
        outs = list(pool.map(lambda r: heads[r]._combined_argmax(padded[:, r * per:(r + 1) * per], list(range(6))),
                             range(tp)))
    got = outs[0]  # the sampling rank's; the others return []
    want = []
    for i in range(6):
        row = full[i].clone()
        row[heads[0].sampler.suppressed_ids(states[i])] = float("-inf")
        want.append(int(row.argmax()))
    assert got == want and got[1] != 2 and got[2:] == [7, 4, V - 1, 3] and got[0] < V
    assert outs[1:] == [[]] * (tp - 1)
    assert heads[1].comm.bytes["tp_logits"] == (6 + 5) * 2 * 8  # five rows with min_tokens send their masked best


def test_tp_threads_greedy_min_tokens_take_the_combined_argmax(llama_dir):
    """Greedy rows with min_tokens (a load test holding outputs at max_tokens sends them) give the single-device
    tokens on TP shards with a few numbers a row through the gather, not the full logits."""
    cfg = EngineConfig(num_kv_blocks=64)
    plain = [SamplingParams(temperature=0, max_tokens=6)] * len(PROMPTS)
    free, _ = run_engine(llama_dir, InProcessExecutor(llama_dir, cfg), cfg, params=plain)
    # each row's own first greedy token as a stop id, ruled out for its first 4 tokens
    params = [SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[free[i][0][0]])
              for i in range(len(PROMPTS))]
    params[0] = plain[0]
    ref, _ = run_engine(llama_dir, InProcessExecutor(llama_dir, cfg), cfg, params=params)
    assert all(ref[i][0][0] != free[i][0][0] for i in range(1, len(PROMPTS)))  # the suppression bit
    for tp in (2, 4):
        ex = ThreadTPExecutor(llama_dir, cfg.replace(tensor_parallel_size=tp))
        outs, _ = run_engine(llama_dir, ex, cfg, params=params)
        ex.shutdown()
        assert outs == ref, tp
        comm = ex.runners[1].comm
        assert comm.bytes["tp_logits"] <= comm.calls["tp_logits"] * 2 * len(PROMPTS) * 2 * 8, comm.bytes
