"""Multiprocess-executor cases, run for the model family named by the importing test module's
FAMILY (one file per family keeps each file under two minutes on two cores).

One executor per layout serves every case of that layout (module-scoped): TP=2, PP=2 and
TP=2 x PP=2 must give the single-device greedy tokens and logits (within 1e-4, fp32), and the
same results under continuous batching, preemption and seeded sampling."""

from __future__ import annotations

import pytest
from parallel_fixtures import PROMPTS, LogitsRecorder, max_logit_error, run_engine

from engines.core.config import EngineConfig
from engines.core.executor import InProcessExecutor
from engines.core.sampling_params import SamplingParams
from engines.parallel.mp_executor import MultiprocExecutor

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
BASE = EngineConfig(num_kv_blocks=64, worker_threads=1, dist_timeout_s=60)
ARRIVALS = [0, 2, 3, 7]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=10 + i, max_tokens=10, ignore_eos=True,
                         logprobs=2) for i in range(len(PROMPTS))]
STAGGERED = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 15)]


@pytest.fixture(scope="module")
def model_path(request, gpt2_dir, llama_dir):
    return gpt2_dir if request.module.FAMILY == "gpt2" else llama_dir


@pytest.fixture(scope="module")
def reference(model_path):
    """Single-device results of every workload below."""
    out = {}
    ex = InProcessExecutor(model_path, BASE)
    out["greedy"], _ = run_engine(model_path, ex, BASE)
    out["staggered"], _ = run_engine(model_path, ex, BASE, params=STAGGERED, arrivals=ARRIVALS)
    out["seeded"], _ = run_engine(model_path, ex, BASE, params=SEEDED)
    small = BASE.replace(num_kv_blocks=5, admission_reserves_growth=False)
    out["preempt"], engine = run_engine(model_path, InProcessExecutor(model_path, small), small)
    out["preemptions"] = engine.scheduler.num_preemptions
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda lp: f"tp{lp[0]}xpp{lp[1]}")
def mp(request, model_path):
    tp, pp = request.param
    # explicit micro-batches (auto would not split these tiny steps): 2, and 3 for an uneven split
    ex = MultiprocExecutor(model_path, BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                    pipeline_microbatches=2 if tp == 1 else 3))
    yield ex
    ex.shutdown()


def test_greedy_tokens_and_logits_match(mp, model_path, reference):
    rec = LogitsRecorder(mp)
    outs, _ = run_engine(model_path, rec, BASE)
    assert outs == reference["greedy"]
    assert max_logit_error(model_path, PROMPTS, outs, rec.logits) < 1e-4


def test_continuous_batching_matches(mp, model_path, reference):
    outs, _ = run_engine(model_path, mp, BASE, params=STAGGERED, arrivals=ARRIVALS)
    assert outs == reference["staggered"]


def test_preemption_matches(mp, model_path, reference):
    # the scheduler sees a 5-block pool (the shards have more; only the ids it hands out are used)
    outs, engine = run_engine(model_path, LogitsRecorder(mp, num_blocks=5), BASE.replace(num_kv_blocks=5, admission_reserves_growth=False))
    assert engine.scheduler.num_preemptions > 0 and reference["preemptions"] > 0
    assert outs == reference["preempt"]


def test_seeded_sampling_matches(mp, model_path, reference):
    outs, _ = run_engine(model_path, mp, BASE, params=SEEDED)
    assert outs == reference["seeded"]


def test_comm_bytes_match_analytic(mp, model_path):
    """Measured payload bytes equal the analytic count: 2 all-reduces of (tokens x C) per layer
    and one after the embedding (TP), one (tokens x C) send per stage boundary (PP)."""
    cfg, layout = mp.model_config, mp.layout
    mp.collect_stats(reset=True)
    outs, _ = run_engine(model_path, mp, BASE)
    stats = mp.collect_stats(reset=True)
    tokens = sum(len(p) for p in PROMPTS) + sum(len(o[0]) - 1 for o in outs.values())
    row = cfg.n_embd * 4  # fp32 bytes of one token's hidden state
    for rank, s in stats.items():
        _, p = layout.coords(rank)
        a, b = layout.stages[p]
        b_ = s["bytes"]
        if layout.tp > 1:
            assert b_["tp_layer"] == 2 * (b - a) * tokens * row
            assert b_.get("tp_embed", 0) == (tokens * row if p == 0 else 0)
        else:
            assert "tp_layer" not in b_
        assert b_.get("pp_send", 0) == (tokens * row if p < layout.pp - 1 else 0)
        assert (b_.get("plan", 0) > 0) == (rank == 0)
        # the one runner: every shard's decode micro-batches took the fused CPU step (TP: split at its
        # all-reduces, whose bytes are the ones counted above), prefill ones the module path
        assert s["paths"].get("fused", 0) > 0 and s["paths"].get("eager", 0) > 0, s["paths"]


def test_memory_per_rank(mp):
    """Each rank holds 1/(TP x PP) of the layer weights plus the replicated parts: the sharded
    loader allocates exactly the shard."""
    infos = mp.shard_info
    for info in infos.values():
        assert info["weight_bytes"] == info["expected_weight_bytes"]
    assert {i["num_blocks"] for i in infos.values()} == {mp.num_blocks}
