"""Every client mistake is a 4xx with its API's error body (OpenAI's; under /v2 the KServe v2 one,
whose `error` is the message string), and no client input is a 5xx."""

from __future__ import annotations

import json

import pytest
from test_serving_app import MODEL, local_client

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
V2 = f"/v2/models/{MODEL}"
TEXT = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}
JSON_CT = {"content-type": "application/json"}

# (id, method, path, request kwargs, status, code, param)
CASES = [
    # transport and body
    ("malformed-json", "POST", "/v1/completions", {"content": b'{"model": ', "headers": JSON_CT}, 400,
     "invalid_json", None),
    ("json-array", "POST", "/v1/completions", {"content": b"[1, 2]", "headers": JSON_CT}, 400, "invalid_json", None),
    ("empty-body", "POST", "/v1/completions", {"content": b"", "headers": JSON_CT}, 400, "invalid_json", None),
    ("invalid-utf8", "POST", "/v1/completions", {"content": b'{"prompt": "\xff"}', "headers": JSON_CT}, 400,
     "invalid_json", None),
    ("deep-nesting", "POST", "/v1/completions", {"content": b"[" * 30_000, "headers": JSON_CT}, 400,
     "invalid_json", None),
    ("wrong-content-type", "POST", "/v1/completions",
     {"content": json.dumps(GOOD).encode(), "headers": {"content-type": "text/plain"}}, 415,
     "unsupported_media_type", None),
    ("form-content-type", "POST", "/v1/chat/completions",
     {"content": b"a=1", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415,
     "unsupported_media_type", None),
    ("body-too-large", "POST", "/v1/completions", {"json": {**GOOD, "prompt": "x" * 70_000}}, 413,
     "request_too_large", None),
    ("unknown-route", "GET", "/v1/nothing", {}, 404, "not_found", None),
    ("wrong-method", "GET", "/v1/completions", {}, 405, "method_not_allowed", None),
    # fields
    ("missing-prompt", "POST", "/v1/completions", {"json": {"model": MODEL}}, 400, "missing_required_parameter",
     "prompt"),
    ("missing-model", "POST", "/v1/completions", {"json": {"prompt": "x"}}, 400, "missing_required_parameter",
     "model"),
    ("model-not-string", "POST", "/v1/completions", {"json": {**GOOD, "model": 3}}, 400, "invalid_type", "model"),
    ("unknown-model", "POST", "/v1/completions", {"json": {**GOOD, "model": "gpt-9"}}, 404, "model_not_found",
     "model"),
    ("unknown-field", "POST", "/v1/completions", {"json": {**GOOD, "temprature": 0.5}}, 400, "unknown_parameter",
     "temprature"),
    ("temperature-string", "POST", "/v1/completions", {"json": {**GOOD, "temperature": "hot"}}, 400,
     "invalid_type", "temperature"),
    ("temperature-range", "POST", "/v1/completions", {"json": {**GOOD, "temperature": 2.5}}, 400, "invalid_value",
     "temperature"),
    ("max-tokens-string", "POST", "/v1/completions", {"json": {**GOOD, "max_tokens": "10"}}, 400, "invalid_type",
     "max_tokens"),
    ("max-tokens-zero", "POST", "/v1/completions", {"json": {**GOOD, "max_tokens": 0}}, 400, "invalid_value",
     "max_tokens"),
    ("max-tokens-negative", "POST", "/v1/completions", {"json": {**GOOD, "max_tokens": -3}}, 400, "invalid_value",
     "max_tokens"),
    ("max-tokens-beyond-context", "POST", "/v1/completions", {"json": {**GOOD, "max_tokens": 100_000}}, 400,
     "context_length_exceeded", "max_tokens"),
    ("prompt-beyond-context", "POST", "/v1/completions", {"json": {**GOOD, "prompt": list(range(1, 300))}}, 400,
     "context_length_exceeded", "prompt"),
    ("token-outside-vocab", "POST", "/v1/completions", {"json": {**GOOD, "prompt": [1, 99_999]}}, 400,
     "invalid_token_id", "prompt"),
    ("empty-prompt", "POST", "/v1/completions", {"json": {**GOOD, "prompt": ""}}, 400, "invalid_value", "prompt"),
    ("empty-prompt-list", "POST", "/v1/completions", {"json": {**GOOD, "prompt": []}}, 400, "invalid_value",
     "prompt"),
    ("mixed-prompt-list", "POST", "/v1/completions", {"json": {**GOOD, "prompt": [1, "a"]}}, 400, "invalid_value",
     "prompt"),
    ("n-zero", "POST", "/v1/completions", {"json": {**GOOD, "n": 0}}, 400, "invalid_value", "n"),
    ("n-too-large", "POST", "/v1/completions", {"json": {**GOOD, "n": 129}}, 400, "invalid_value", "n"),
    ("n-beyond-admission", "POST", "/v1/completions", {"json": {**GOOD, "n": 100}}, 400, "invalid_value", "n"),
    ("n-bool", "POST", "/v1/completions", {"json": {**GOOD, "n": True}}, 400, "invalid_type", "n"),
    ("logprobs-too-many", "POST", "/v1/completions", {"json": {**GOOD, "logprobs": 6}}, 400, "invalid_value",
     "logprobs"),
    ("logprobs-negative", "POST", "/v1/completions", {"json": {**GOOD, "logprobs": -1}}, 400, "invalid_value",
     "logprobs"),
    ("top-p-zero", "POST", "/v1/completions", {"json": {**GOOD, "top_p": 0}}, 400, "invalid_value", "top_p"),
    ("top-k-huge", "POST", "/v1/completions", {"json": {**GOOD, "top_k": 2**63}}, 400, "invalid_value", "top_k"),
    ("seed-huge", "POST", "/v1/completions", {"json": {**GOOD, "seed": 2**70}}, 400, "invalid_value", "seed"),
    ("stop-too-many", "POST", "/v1/completions", {"json": {**GOOD, "stop": [str(i) for i in range(17)]}}, 400,
     "invalid_value", "stop"),
    ("stop-wrong-type", "POST", "/v1/completions", {"json": {**GOOD, "stop": 5}}, 400, "invalid_value", "stop"),
    ("min-over-max", "POST", "/v1/completions", {"json": {**GOOD, "min_tokens": 10}}, 400, "invalid_value",
     "min_tokens"),
    ("penalty-range", "POST", "/v1/completions", {"json": {**GOOD, "presence_penalty": 3}}, 400, "invalid_value",
     "presence_penalty"),
    ("stream-options-without-stream", "POST", "/v1/completions",
     {"json": {**GOOD, "stream_options": {"include_usage": True}}}, 400, "invalid_value", "stream_options"),
    ("logit-bias", "POST", "/v1/completions", {"json": {**GOOD, "logit_bias": {"5": 10}}}, 400, "invalid_value",
     "logit_bias"),
    ("suffix", "POST", "/v1/completions", {"json": {**GOOD, "suffix": "end"}}, 400, "invalid_value", "suffix"),
    ("best-of", "POST", "/v1/completions", {"json": {**GOOD, "best_of": 3}}, 400, "invalid_value", "best_of"),
    # chat
    ("chat-missing-messages", "POST", "/v1/chat/completions", {"json": {"model": MODEL}}, 400,
     "missing_required_parameter", "messages"),
    ("chat-empty-messages", "POST", "/v1/chat/completions", {"json": {**CHAT, "messages": []}}, 400,
     "invalid_value", "messages"),
    ("chat-bad-role", "POST", "/v1/chat/completions",
     {"json": {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}}, 400, "invalid_value",
     "messages[0].role"),
    ("chat-unknown-message-field", "POST", "/v1/chat/completions",
     {"json": {**CHAT, "messages": [{"role": "user", "content": "x", "mood": "happy"}]}}, 400,
     "unknown_parameter", "messages[0].mood"),
    ("chat-image-part", "POST", "/v1/chat/completions",
     {"json": {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}}, 400,
     "invalid_value", "messages[0].content"),
    ("chat-top-logprobs-range", "POST", "/v1/chat/completions",
     {"json": {**CHAT, "logprobs": True, "top_logprobs": 21}}, 400, "invalid_value", "top_logprobs"),
    ("chat-top-logprobs-alone", "POST", "/v1/chat/completions", {"json": {**CHAT, "top_logprobs": 2}}, 400,
     "invalid_value", "top_logprobs"),
    ("chat-tools", "POST", "/v1/chat/completions", {"json": {**CHAT, "tools": [{"type": "function"}]}}, 400,
     "missing_required_parameter", "tools[0].function"),
    ("chat-json-schema-missing", "POST", "/v1/chat/completions",
     {"json": {**CHAT, "response_format": {"type": "json_schema"}}}, 400, "invalid_value", "response_format"),
    ("chat-beyond-context", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 5000}}, 400,
     "context_length_exceeded", "max_tokens"),
    ("chat-unknown-model", "POST", "/v1/chat/completions", {"json": {**CHAT, "model": "x"}}, 404,
     "model_not_found", "model"),
    # KServe v2
    ("v2-unknown-model", "GET", "/v2/models/nope", {}, 404, "model_not_found", "model"),
    ("v2-unknown-model-ready", "GET", "/v2/models/nope/ready", {}, 404, "model_not_found", "model"),
    ("v2-unknown-version", "GET", f"{V2}/versions/7", {}, 404, "model_version_not_found", None),
    ("v2-infer-no-inputs", "POST", f"{V2}/infer", {"json": {"inputs": []}}, 400, "missing_required_parameter",
     "inputs"),
    ("v2-infer-no-text", "POST", f"{V2}/infer",
     {"json": {"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [3]}]}}, 400,
     "missing_required_parameter", "inputs[text_input]"),
    ("v2-infer-text-not-bytes", "POST", f"{V2}/infer",
     {"json": {"inputs": [{**TEXT, "datatype": "INT32", "data": [1]}]}}, 400, "invalid_value",
     "inputs[text_input].datatype"),
    ("v2-infer-unknown-input", "POST", f"{V2}/infer",
     {"json": {"inputs": [TEXT, {"name": "beam", "datatype": "INT32", "shape": [1], "data": [2]}]}}, 400,
     "unknown_parameter", "inputs[beam]"),
    ("v2-infer-shape-mismatch", "POST", f"{V2}/infer", {"json": {"inputs": [{**TEXT, "shape": [2]}]}}, 400,
     "invalid_value", "inputs[text_input]"),
    ("v2-infer-bad-parameter", "POST", f"{V2}/infer",
     {"json": {"inputs": [TEXT], "parameters": {"max_tokens": "many"}}}, 400, "invalid_type", "parameters.max_tokens"),
    ("v2-infer-beyond-context", "POST", f"{V2}/infer", {"json": {"inputs": [TEXT], "parameters": {"max_tokens": 999}}},
     400, "context_length_exceeded", "parameters.max_tokens"),
    ("v2-infer-unknown-field", "POST", f"{V2}/infer", {"json": {"inputs": [TEXT], "priority": 1}}, 400,
     "unknown_parameter", "priority"),
    ("v2-infer-bad-binary-header", "POST", f"{V2}/infer",
     {"content": b'{"inputs": []}', "headers": {"Inference-Header-Content-Length": "999"}}, 400, "invalid_header",
     None),
    ("v2-infer-unknown-model", "POST", "/v2/models/nope/infer", {"json": {"inputs": [TEXT]}}, 404, "model_not_found",
     "model"),
    ("v2-generate-no-text", "POST", f"{V2}/generate", {"json": {"max_tokens": 3}}, 400,
     "missing_required_parameter", "text_input"),
    ("v2-generate-text-not-string", "POST", f"{V2}/generate_stream", {"json": {"text_input": 5}}, 400,
     "invalid_value", "text_input"),
    ("v2-generate-unknown-parameter", "POST", f"{V2}/generate", {"json": {"text_input": "x", "beams": 2}}, 400,
     "unknown_parameter", "beams"),
    ("v2-generate-both-places", "POST", f"{V2}/generate",
     {"json": {"text_input": "x", "max_tokens": 2, "parameters": {"max_tokens": 3}}}, 400, "invalid_value",
     "max_tokens"),
]


@pytest.fixture(scope="module")
def client(gpt2_dir):
    # a small body limit so the 413 case is cheap; capacity 8 + 16 sequences per request
    with local_client(gpt2_dir, server={"max_body_bytes": 64 * 1024}) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_with_openai_error(client, case):
    _, method, path, kwargs, status, code, param = case
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    if path.startswith("/v2"):  # tritonclient reads `error` as the message string
        assert set(body) == {"error", "type", "param", "code"} and isinstance(body["error"], str), body
        err = {**body, "message": body["error"]}
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        err = body["error"]
    assert err["code"] == code, err
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    assert r.headers.get("x-request-id")


def test_streaming_request_errors_before_the_stream(client):
    r = client.post("/v1/completions", json={**GOOD, "max_tokens": 100_000, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "context_length_exceeded"


VALUES = [None, True, 0, 1, -1, 2**31, 2**63, -(2**63), 2**64, 10**30, 1e-300, 1e308, -1e308, "", "x", [], [1], {},
          {"a": 1}, 0.5, 129]


def test_no_client_input_is_a_5xx(client):
    """A grid of odd values for every field of every generating route; the engine stays healthy."""
    fields = {
        "/v1/completions": (GOOD, ["max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
                                   "echo", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
                                   "stop_token_ids", "repetition_penalty", "best_of", "stream_options", "prompt",
                                   "model"]),
        "/v1/chat/completions": (CHAT, ["max_tokens", "max_completion_tokens", "top_logprobs", "logprobs", "seed",
                                        "messages", "response_format", "tools", "chat_template_kwargs", "top_k"]),
        f"{V2}/generate": ({"text_input": "hi", "max_tokens": 3}, ["max_tokens", "top_k", "seed", "stop",
                                                                   "temperature", "parameters", "text_input"]),
    }
    failures = []
    for path, (base, names) in fields.items():
        for name in names:
            for v in VALUES:
                r = client.post(path, content=json.dumps({**base, name: v}), headers=JSON_CT)
                if r.status_code >= 500:
                    failures.append((path, name, v, r.status_code, r.text[:200]))
    for v in VALUES:
        body = {"inputs": [TEXT, {"name": "top_k", "datatype": "INT64", "shape": [1], "data": [v]}]}
        r = client.post(f"{V2}/infer", content=json.dumps(body), headers=JSON_CT)
        if r.status_code >= 500:
            failures.append(("infer", "top_k", v, r.status_code, r.text[:200]))
    assert not failures, failures
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json=GOOD).status_code == 200
