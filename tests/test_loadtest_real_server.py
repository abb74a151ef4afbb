"""The load-test harness against the real server (gateway app + engine, uvicorn on 127.0.0.1)."""

from __future__ import annotations

import math

import pytest
from test_serving_app import MODEL
from test_serving_faults import make_core, serve_http

import loadtest
from loadtest.config import LoadTestConfig, parse_slo
from loadtest.report import write_run


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat", "kserve-generate-stream"])
def test_loadtest_against_the_real_server(gpt2_dir, tmp_path, backend):
    core = make_core(gpt2_dir, engine={"max_num_seqs": 8, "cpu_linear_autotune": False}, max_waiting=64)
    with serve_http(core) as (url, _):
        report = loadtest.run(LoadTestConfig(
            url=url, model=MODEL, backend=backend, request_rate=20.0, arrival="poisson", num_prompts=12,
            random_input_len=12, random_output_len=10, ignore_eos=True,
            tokenizer=gpt2_dir / "tokenizer.json", progress=False,
            slos=(parse_slo("e2el_ms=600000"),)))
    s = report.summary
    assert (s.requests, s.completed, s.failed) == (12, 12, 0), s.errors
    assert s.prompt_lengths == "exact"
    if backend != "kserve-generate-stream":  # the OpenAI paths report usage: exact token counts
        assert s.total_output_tokens == 12 * 10
    assert all(r.ttft_s > 0 and r.e2el_s >= r.ttft_s for r in report.records)
    assert not math.isnan(s.itl_ms.p50)
    assert s.good_requests == 12
    files = write_run(report, tmp_path / "out")
    assert {f.suffix for f in files} >= {".jsonl", ".json", ".csv", ".png"}
