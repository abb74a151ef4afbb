"""GET /v1/admin/steps: each replica's latest engine steps (the tuner's served-step fit reads them).

In-process (the real engine behind the gateway app) for the content and the keys; "every replica"
(two replicas of one model, a TP2 one, through Ray Serve) is in test_serving_ray, on its server."""

from __future__ import annotations

import itertools

import pytest
from starlette.testclient import TestClient

from deploy.schema import validate_config
from engines.core.config import ConfigError, EngineConfig
from engines.core.llm_engine import STEP_LOG_LEN
from engines.core.step_record import STEP_FIELDS, STEP_RECORD_MAX, StepRecorder
from serving.app import create_local_app

ENGINE = {"num_kv_blocks": 512, "max_num_seqs": 8, "cpu_linear_autotune": False}


def _client(model_dir, api_keys=(), admin_keys=(), **engine) -> TestClient:
    cfg = validate_config({"models": [{"name": "m", "path": str(model_dir), "engine": {**ENGINE, **engine}}],
                           "server": {"log_requests": False}})
    return TestClient(create_local_app(cfg, api_keys=list(api_keys), admin_keys=list(admin_keys)),
                      raise_server_exceptions=False)


def _complete(c: TestClient, prompt: list[int], n_tokens: int, headers=None) -> None:
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": n_tokens, "ignore_eos": True,
                                        "temperature": 0}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n_tokens


def test_steps_describe_what_the_engine_ran(gpt2_dir):
    with _client(gpt2_dir) as c:
        _complete(c, list(range(1, 12)), 6)  # 11 prompt tokens, 6 outputs: one prefill, 5 decodes
        r = c.get("/v1/admin/steps", params={"model": "m"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "m" and len(body["data"]) == 1
        rep = body["data"][0]
        assert rep["layout"]["tensor_parallel_size"] == 1 and rep["layout"]["max_num_seqs"] == 8
        steps = rep["steps"]
        assert [set(s) for s in steps] == [set(STEP_FIELDS)] * len(steps)
        assert len(steps) == 6
        first, decodes = steps[0], steps[1:]
        assert (first["prefill_seqs"], first["prefill_tokens"], first["decode_seqs"], first["sampled"]) == (1, 11, 0, 1)
        assert first["prefill_attention_pairs"] == 11 * 12 // 2  # query at position p attends to p + 1 keys
        # decode k (k = 1..5) reads the prompt and the k tokens before it: context 12, 13, ...
        assert [s["decode_context_tokens"] for s in decodes] == [12, 13, 14, 15, 16]
        assert all(s["decode_seqs"] == 1 and s["prefill_tokens"] == 0 and s["sampled"] == 1 for s in decodes)
        assert all(0 < s["seconds"] < 60 for s in steps)
        # the engine waited for the request before its first step; between its own steps it did not idle
        assert first["gap_s"] is None
        assert all(s["gap_s"] is not None and 0 <= s["gap_s"] < 5 for s in decodes)
        ends = [s["end_s"] for s in steps]
        assert ends == sorted(ends) and ends[-1] <= rep["clock_s"]
        for a, b in itertools.pairwise(steps):  # end - seconds - gap = the previous step's end
            assert b["end_s"] - b["seconds"] - b["gap_s"] == pytest.approx(a["end_s"], abs=2e-3)

        two = c.get("/v1/admin/steps", params={"limit": "2"}).json()  # one model served: model may be left out
        assert two["data"][0]["steps"] == steps[-2:]


def test_bad_arguments_are_named(gpt2_dir):
    with _client(gpt2_dir) as c:
        # "²" and "٣" are str.isdigit(), and int() refuses 5000 digits: none may become a 500
        for bad in ("0", str(STEP_LOG_LEN + 1), "x", "-3", "²", "٣", "9" * 5000, "1_0"):
            r = c.get("/v1/admin/steps", params={"limit": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", (bad, r.text)
            assert str(STEP_LOG_LEN) in r.json()["error"]["message"]
        r = c.get("/v1/admin/steps", params={"model": "nope"})
        assert r.status_code == 404, r.text


def test_the_recorder_is_sized_by_the_engine_config():
    """EngineConfig.step_record_len sizes the engine's step recorder (no environment variable); a
    bad size names the field."""
    assert EngineConfig().step_record_len == STEP_LOG_LEN
    for bad in (0, -1, STEP_RECORD_MAX + 1, "x", True):
        with pytest.raises(ConfigError, match="step_record_len"):
            EngineConfig(step_record_len=bad)
        with pytest.raises(ValueError, match="step_record_len"):
            StepRecorder(bad)
    rec = StepRecorder(2)
    assert rec.capacity == 2 and rec.rows() == ()


def test_a_longer_window_keeps_a_whole_run(gpt2_dir):
    """engine.step_record_len (the tuner's accuracy runs set it in their deployment config) keeps
    more than the default 256 steps, and the route's limit follows it."""
    with _client(gpt2_dir, step_record_len=STEP_LOG_LEN + 100) as c:
        for _ in range(STEP_LOG_LEN // 16 + 2):  # a prefill and 15 decodes each: past STEP_LOG_LEN steps
            _complete(c, [1, 2, 3], 16)
        steps = c.get("/v1/admin/steps").json()["data"][0]["steps"]
        assert len(steps) == (STEP_LOG_LEN // 16 + 2) * 16 > STEP_LOG_LEN
        assert c.get("/v1/admin/steps", params={"limit": str(STEP_LOG_LEN + 100)}).status_code == 200
        r = c.get("/v1/admin/steps", params={"limit": str(STEP_LOG_LEN + 101)})
        assert r.status_code == 400 and str(STEP_LOG_LEN + 100) in r.json()["error"]["message"]


def test_admin_key_required_when_keys_are_configured(gpt2_dir):
    with _client(gpt2_dir, api_keys=("usr",), admin_keys=("adm",)) as c:
        _complete(c, [5, 6, 7], 2, headers={"Authorization": "Bearer usr"})
        assert c.get("/v1/admin/steps").status_code == 401
        assert c.get("/v1/admin/steps", headers={"Authorization": "Bearer usr"}).status_code == 403
        r = c.get("/v1/admin/steps", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and len(r.json()["data"][0]["steps"]) == 2
    with _client(gpt2_dir, api_keys=("usr",)) as c:  # user keys but no admin keys: admin routes are off
        r = c.get("/v1/admin/steps", headers={"Authorization": "Bearer usr"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
