"""Tuner: TPOT as the load tester sees a streamed reply (chunks, a final chunk without text)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.core.scheduler import SchedulerConfig
from tuner.probe_model import text_token_share, write_tokenizer
from tuner.simulate import simulate
from tuner.stream import stream_interval_s

STEP = 1 / 128  # 7.8125 ms, exact in binary: chunk boundaries do not depend on rounding
CFG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64, max_model_len=64)


def test_mirrored_constants_equal_the_replicas():
    """tuner.stream mirrors serving.model_core (the tuner may not import serving): a change there
    must be made here too."""
    from serving import model_core
    from tuner import stream

    assert stream.STREAM_CHUNKS_PER_S == model_core.ADAPTIVE_CHUNK_RATE
    assert stream.STREAM_INTERVAL_BOUNDS_S == (model_core.MIN_ADAPTIVE_INTERVAL_S, model_core.MAX_ADAPTIVE_INTERVAL_S)


def test_stream_interval_follows_the_replicas_rule():
    # serving.model_core: active / 400 per second, within [20 ms, 250 ms]
    assert stream_interval_s(1) == 0.02
    assert stream_interval_s(16) == pytest.approx(0.04)
    assert stream_interval_s(1000) == 0.25


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_tpot_stops_at_the_last_chunk_with_text(share):
    # one request alone, 10 tokens at STEP apart: the replica sends token 0 at once, then the first
    # token >= 20 ms after the last chunk (tokens 3 and 6); tokens 7-9 are the final chunk, which the
    # client counts only when one of its 3 tokens has text
    (tr,) = simulate(lambda w: STEP, CFG, np.array([0.0]), np.array([5]), np.array([10]), text_share=share)
    assert tr.token_times == pytest.approx([STEP * (j + 1) for j in range(10)])
    p_text = 1 - (1 - share) ** 3
    seen = p_text * 9 * STEP + (1 - p_text) * 6 * STEP
    assert tr.tpot == pytest.approx(seen / 9)
    assert tr.ttft == pytest.approx(STEP)  # the first chunk is never held
    if share == 1.0:
        assert tr.seen_last is None  # every token has text: the engine's own last token


def test_default_share_leaves_the_schedule_alone():
    arr, il, ol = np.array([0.0, 0.003, 0.05]), np.array([5, 7, 3]), np.array([12, 4, 9])
    plain = simulate(lambda w: STEP, CFG, arr, il, ol)
    assert all(t.seen_last is None for t in plain)
    cut = simulate(lambda w: STEP, CFG, arr, il, ol, text_share=0.0)
    assert [t.token_times for t in cut] == [t.token_times for t in plain]
    assert all(c.tpot <= p.tpot for c, p in zip(cut, plain, strict=True))


def test_text_token_share_of_a_probe_tokenizer(tmp_path):
    size = write_tokenizer(tmp_path, vocab_size=512)
    share = text_token_share(tmp_path / "tokenizer.json", 8192)
    # ids past the tokenizer's entries decode to nothing; the 128 bytes of multi-byte UTF-8
    # characters and <|endoftext|> decode to no text alone
    assert 0 < share * 8192 <= size - 128 - 1
    assert text_token_share(tmp_path / "tokenizer.json", size) == pytest.approx(share * 8192 / size)


def test_refit_reads_truncated_tpots_as_the_client_measures_them():
    """Runs 'measured' by a client that leaves out final chunks without text (a random checkpoint's
    tokenizer): the refit, told the share of ids with text, still finds the step factor."""
    from engines.core.config import ModelConfig
    from tuner.cost import CostModel
    from tuner.profiles import HardwareProfile
    from tuner.refit import Run, refit

    tiny = ModelConfig(model_type="gpt2", vocab_size=320, n_layer=2, n_head=4, n_embd=64, max_position_embeddings=128)
    base = {"name": "unit-cpu", "kind": "measured", "memory_gib": 8.0, "hbm_bandwidth_gb_s": 10.0,
            "flops_tflops": {"float32": 0.05}, "intra_node_bandwidth_gb_s": 1.0, "inter_node_bandwidth_gb_s": 1.0,
            "devices_per_node": 2, "cores": 2, "reserved_memory_gib": 1.0, "layer_overhead_us": 200.0,
            "collective_latency_us": 300.0, "request_overhead_ms": 5.0}
    truth = HardwareProfile(**{**base, "step_overhead_ms": 3.0})
    start = HardwareProfile(**{**base, "step_overhead_ms": 1.0})
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_blocks=64, max_model_len=100)
    rng = np.random.default_rng(1)
    runs = []
    for rate in (5.0, 20.0):
        arr = np.cumsum(rng.exponential(1 / rate, 30))
        ins, outs = rng.integers(8, 40, 30), rng.integers(8, 30, 30)
        tr = simulate(CostModel(tiny, truth, weight_dtype="float32").step_time, sched, arr, ins, outs,
                      request_overhead=truth.request_overhead_ms * 1e-3, text_share=0.05)
        runs.append(Run(tiny, 1, 1, "float32", sched, arr, ins, outs, np.array([t.ttft for t in tr]),
                        np.array([t.tpot for t in tr]), text_share=0.05))
    _, factors = refit(start, runs, free=("step", "request"))
    assert factors["step"] == pytest.approx(3.0, rel=0.1)
