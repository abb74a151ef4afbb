"""The gateway app in-process (no Ray) with the real engine and a tiny model: OpenAI and KServe v2
routes, streaming, metrics, request ids, API keys. Bad inputs: see test_serving_errors.py."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from deploy.schema import validate_config
from engines import LLM, SamplingParams
from serving.app import create_local_app
from serving.chat import DEFAULT_CHAT_TEMPLATE, render_chat

T0 = time.monotonic()  # before any engine of this module exists

ROOT = Path(__file__).resolve().parents[1]
MODEL = "gpt2"


def local_client(model_dir: Path, name: str = MODEL, api_keys: list[str] | None = None, server: dict | None = None,
                 **spec) -> TestClient:
    spec = {"engine": {"num_kv_blocks": 512, "max_num_seqs": 8, "cpu_linear_autotune": False}, "max_waiting": 16,
            **spec}
    cfg = validate_config({"models": [{"name": name, "path": str(model_dir), **spec}],
                           "server": {"log_requests": False, **(server or {})}})
    return TestClient(create_local_app(cfg, api_keys=api_keys), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(gpt2_dir):
    with local_client(gpt2_dir) as c:
        yield c


def sse(lines) -> tuple[list[dict], bool]:
    """Decoded `data:` events and whether the stream ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            assert not done, "event after [DONE]"
            events.append(json.loads(payload))
    return events, done


def stream(client: TestClient, path: str, body: dict) -> tuple[list[dict], bool]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse(r.iter_lines())


def offline(model_dir: Path, prompt: str, **params) -> str:
    return LLM(str(model_dir), cpu_linear_autotune=False).generate(prompt, SamplingParams(**params))[0].outputs[0].text


# /v1/models
def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


# /v1/completions
def test_greedy_completion_matches_offline_engine(client, gpt2_dir):
    body = {"model": MODEL, "prompt": "To be, or not to be", "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL and out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == offline(gpt2_dir, "To be, or not to be", max_tokens=12, temperature=0)
    usage = out["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_prompt_forms_and_n(client):
    ids = client.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 1,
                                               "echo": True, "logprobs": 0}).json()
    prompt_ids_len = ids["usage"]["prompt_tokens"]
    for prompt, count in (("hello", 1), (["hello", "world"], 2), ([5, 6, 7], 1), ([[5, 6], [7, 8, 9]], 2)):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 2})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(2 * count))
        assert all(c["finish_reason"] == "length" for c in choices)
        assert r.json()["usage"]["completion_tokens"] == 3 * 2 * count
    assert prompt_ids_len == 2


def test_seeded_sampling_is_reproducible(client):
    body = {"model": MODEL, "prompt": "the slings", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b


def test_echo_with_logprobs(client):
    body = {"model": MODEL, "prompt": "To be, or not", "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 2}
    out = client.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"].startswith("To be, or not")
    lp = choice["logprobs"]
    n = out["usage"]["prompt_tokens"] + 4
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token has none
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    # token texts are per-token decodes (a token holding part of a UTF-8 character shows as U+FFFD)
    assert "".join(lp["tokens"]).startswith("To be, or not")
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    # greedy: the chosen token is the most likely one
    for tok, top in zip(lp["tokens"][-4:], lp["top_logprobs"][-4:]):
        assert max(top, key=top.get) == tok


def test_stop_string_ends_the_completion(client):
    full = client.post("/v1/completions", json={"model": MODEL, "prompt": "To be", "max_tokens": 20,
                                                 "temperature": 0}).json()["choices"][0]["text"]
    stop = full[5:8]
    assert stop and stop in full
    out = client.post("/v1/completions", json={"model": MODEL, "prompt": "To be", "max_tokens": 20,
                                                "temperature": 0, "stop": [stop]}).json()["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[:full.index(stop)]


def test_streaming_completion_matches_non_streaming(client):
    body = {"model": MODEL, "prompt": "Whether 'tis nobler", "max_tokens": 10, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    events, done = stream(client, "/v1/completions", {**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    assert done
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    assert all(e["object"] == "text_completion" and e["model"] == MODEL for e in events)
    assert len({e["id"] for e in events}) == 1
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-1])


def test_streamed_logprobs_match_non_streaming_with_a_stop_string(client):
    # a stop string makes the server hold back text while tokens go out: the streamed text_offset
    # must still count token texts, as the non-streaming reply does
    body = {"model": MODEL, "prompt": "Whether 'tis nobler", "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "stop": ["\x01 never \x02"]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    events, done = stream(client, "/v1/completions", {**body, "stream": True})
    assert done
    got = {k: [x for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"][k]]
           for k in ("tokens", "text_offset")}
    assert got == {k: whole[k] for k in ("tokens", "text_offset")}
    assert whole["text_offset"] == [sum(len(t) for t in whole["tokens"][:i]) for i in range(12)]


def test_streaming_without_usage_has_no_usage_field(client):
    events, done = stream(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True})
    assert done and events and all("usage" not in e for e in events)


# /v1/chat/completions
def test_chat_uses_the_tokenizers_template(client, gpt2_dir):
    from tokenizers import Tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 5,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    tmpl = json.loads((gpt2_dir / "tokenizer_config.json").read_text())["chat_template"]
    rendered = render_chat(messages, tmpl)
    assert rendered == "<|system|>Be brief.<|end|><|user|>Hello there<|end|><|assistant|>"
    tk = Tokenizer.from_file(str(gpt2_dir / "tokenizer.json"))
    assert out["usage"]["prompt_tokens"] == len(tk.encode(rendered, add_special_tokens=False).ids)
    assert out["usage"]["completion_tokens"] == 5


def test_chat_streaming_and_logprobs(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.post("/v1/chat/completions", json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        # a token holding part of a UTF-8 character shows as U+FFFD but has its real bytes
        assert entry["bytes"] == list(entry["token"].encode()) or "\ufffd" in entry["token"]
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]
    joined = bytes(b for entry in content for b in entry["bytes"]).decode(errors="replace")
    assert joined == whole["choices"][0]["message"]["content"]
    events, done = stream(client, "/v1/chat/completions", {**body, "stream": True,
                                                            "stream_options": {"include_usage": True}})
    assert done
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == 6
    streamed = [x for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]


def test_default_chat_template_is_documented_and_used():
    text = render_chat([{"role": "user", "content": "hi"}], None)
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    assert "<|assistant|>" in DEFAULT_CHAT_TEMPLATE


def test_chat_template_is_sandboxed():
    from serving.errors import APIError

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(APIError) as exc:
        render_chat([{"role": "user", "content": "x"}], evil)
    assert exc.value.info.status == 400
    with pytest.raises(APIError, match="rejected"):
        render_chat([{"role": "user", "content": "x"}], "{{ raise_exception('no system role') }}")


# KServe v2
def test_v2_health_and_metadata(client):
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
    meta = client.get(f"/v2/models/{MODEL}").json()
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": [-1]} in meta["inputs"]
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
    assert client.get(f"/v2/models/{MODEL}/versions/1").json()["name"] == MODEL
    assert client.get("/v2").json()["name"] == "shardserve"
    assert client.get(f"/v2/models/{MODEL}/config").json()["name"] == MODEL


def test_v2_infer_json_matches_completions(client):
    want = client.post("/v1/completions", json={"model": MODEL, "prompt": ["To be", "or not"], "max_tokens": 5,
                                                 "temperature": 0}).json()["choices"]
    body = {"id": "req-1",
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2, 1], "data": [["To be"], ["or not"]]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [5]}],
            "parameters": {"temperature": 0}}
    r = client.post(f"/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_name"] == MODEL and out["id"] == "req-1"
    (o,) = out["outputs"]
    assert o["name"] == "text_output" and o["datatype"] == "BYTES" and o["shape"] == [2, 1]
    assert o["data"] == [c["text"] for c in want]


def test_v2_infer_stop_tensor_holds_several_strings(client):
    full = client.post("/v1/completions", json={"model": MODEL, "prompt": "To be", "max_tokens": 20,
                                                 "temperature": 0}).json()["choices"][0]["text"]
    stop = full[5:8]
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["To be"]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [20]},
                       {"name": "stop", "datatype": "BYTES", "shape": [2], "data": ["\x01never", stop]}],
            "parameters": {"temperature": 0}}
    r = client.post(f"/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [full[:full.index(stop)]]


def test_v2_infer_binary_tensors_as_tritonclient_sends_them(client):
    import numpy as np
    from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput, InferResult

    text = InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"To be, or not"], dtype=np.object_))  # binary by default
    max_tokens = InferInput("max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([4], dtype=np.int32))
    temp = InferInput("temperature", [1], "FP32")
    temp.set_data_from_numpy(np.array([0.0], dtype=np.float32))
    body, json_size = InferenceServerClient.generate_request_body(
        [text, max_tokens, temp], outputs=[InferRequestedOutput("text_output")])
    r = client.post(f"/v2/models/{MODEL}/infer", content=body,
                    headers={"Inference-Header-Content-Length": str(json_size)})
    assert r.status_code == 200, r.text
    header = r.headers["inference-header-content-length"]
    result = InferResult.from_response_body(r.content, header_length=int(header))
    got = result.as_numpy("text_output")
    want = client.post("/v1/completions", json={"model": MODEL, "prompt": "To be, or not", "max_tokens": 4,
                                                 "temperature": 0}).json()["choices"][0]["text"]
    assert got.shape == (1,) and got[0].decode() == want


def test_v2_generate_and_generate_stream(client):
    body = {"text_input": "To be", "max_tokens": 6, "parameters": {"temperature": 0}}
    out = client.post(f"/v2/models/{MODEL}/generate", json=body).json()
    assert out["model_name"] == MODEL and out["model_version"] == "1" and out["finish_reason"] == "length"
    with client.stream("POST", f"/v2/models/{MODEL}/generate_stream", json=body) as r:
        assert r.status_code == 200
        events, done = sse(r.iter_lines())
    assert not done  # the Triton generate stream has no [DONE] marker
    assert "".join(e["text_output"] for e in events) == out["text_output"]
    assert events[-1]["finish_reason"] == "length"


# observability
def test_request_id_header(client):
    r = client.get("/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    headers={"X-Request-Id": "my-trace-42"})
    assert r.headers["x-request-id"] == "my-trace-42" and r.json()["id"] == "cmpl-my-trace-42"
    for bad_id in ("has spaces", "x" * 200):
        assert client.get("/v1/models", headers={"X-Request-Id": bad_id}).headers["x-request-id"] != bad_id
    # errors carry it too
    assert client.post("/v1/completions", content=b"{").headers["x-request-id"]


def test_request_log_is_structured(gpt2_dir, caplog):
    with local_client(gpt2_dir, server={"log_requests": True}) as c, caplog.at_level("INFO", "shardserve.access"):
        c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
               headers={"X-Request-Id": "log-me"})
    records = [json.loads(r.message) for r in caplog.records if r.name == "shardserve.access"]
    (rec,) = [r for r in records if r["request_id"] == "log-me"]
    assert rec["status"] == 200 and rec["model"] == MODEL and rec["path"] == "/v1/completions"
    assert rec["completion_tokens"] == 2 and rec["duration_ms"] > 0


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


def test_metrics_cover_latency_tokens_and_engine_state(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "metrics please", "max_tokens": 4})
    client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert metric(m, f"shardserve_{hist}_count", model=MODEL) > 0, hist
        assert metric(m, f"shardserve_{hist}_bucket", model=MODEL, le="+Inf") > 0
    assert metric(m, "shardserve_prompt_tokens_total", model=MODEL) > 0
    assert metric(m, "shardserve_generation_tokens_total", model=MODEL) >= 4
    assert metric(m, "shardserve_requests_finished_total", model=MODEL, finish_reason="length") > 0
    assert metric(m, "shardserve_http_requests_total", route="/v1/completions", status="200", model=MODEL) > 0
    assert metric(m, "shardserve_http_requests_total", route="/v1/completions", status="404") >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"):
        assert (f"shardserve_{gauge}", frozenset({("model", MODEL), ("replica", "local")})) in m
    # the engine loop's work: at least one step per generated token of the 4-token request, and
    # busy time that is positive but no more than the time since the client started
    assert metric(m, "shardserve_engine_steps_total", model=MODEL) >= 4
    assert 0 < metric(m, "shardserve_engine_busy_seconds_total", model=MODEL) < time.monotonic() - T0


# auth
def test_api_keys_are_enforced(gpt2_dir):
    with local_client(gpt2_dir, api_keys=["sk-good"]) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"},
                        {"Authorization": "Basic sk-good"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer sk-good"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        for path in ("/v1/models", "/metrics", f"/v2/models/{MODEL}", "/v2"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=ok).status_code == 200, path
        for path in ("/v2/health/live", "/v2/health/ready", "/health"):  # health checks stay open
            assert c.get(path).status_code == 200, path


def test_gateway_modules_import_no_torch():
    code = ("import sys; import serving.app, serving.gateway, serving.openai_api, serving.kserve_api, "
            "serving.backends, serving.deployments, serving.protocol, serving.chat, serving.metrics; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, "the gateway imported torch\n" + out.stderr


def test_binary_bytes_tensor_roundtrip_helper():
    from serving.kserve_tensors import _decode_bytes

    raw = b"".join(struct.pack("<I", len(s)) + s for s in (b"a", "é".encode(), b""))
    assert _decode_bytes(raw, "x") == ["a", "é", ""]
