"""Per-request limits from the deployment schema (server.limits): n, prompt and output tokens, stop
sequences and logprobs, for OpenAI and KServe v2 requests; a 400 naming the field and the limit,
and the OpenAPI document states the same limits."""

from __future__ import annotations

import pytest
from test_serving_app import MODEL, local_client

LIMITS = {"max_n": 2, "max_prompt_tokens": 8, "max_tokens": 6, "max_stop": 2, "max_stop_chars": 5,
          "max_logprobs": 1}


@pytest.fixture(scope="module")
def client(gpt2_dir):
    with local_client(gpt2_dir, server={"limits": LIMITS, "max_body_bytes": 4096}) as c:
        yield c


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 3}, "n", "at most 2"),
    ({"stop": ["a", "b", "c"]}, "stop", "at most 2 stop"),
    ({"stop": "abcdef"}, "stop", "at most 5 characters"),
    ({"logprobs": 2}, "logprobs", "at most 1 alternatives"),
    ({"max_tokens": 7}, "max_tokens", "at most 6"),
    ({"prompt": "one two three four five six seven eight nine ten eleven"}, "prompt", "at most 8"),
])
def test_completion_limits(client, body, param, words):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "server.limits." in err["message"], err


def test_within_limits_is_served_and_other_apis_are_limited_too(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 6, "n": 2,
                                              "stop": ["ab", "cd"], "logprobs": 1})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "logprobs": True, "top_logprobs": 2, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = client.post(f"/v2/models/{MODEL}/generate", json={"text_input": "hi", "parameters": {"max_tokens": 9}})
    assert r.status_code == 400 and r.json()["error"].startswith("parameters.max_tokens: at most 6")  # v2: a string
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413  # server.max_body_bytes


def test_openapi_states_the_configured_limits(client):
    comp = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]

    def bound(prop, key):
        return next(s[key] for s in prop.get("anyOf", [prop]) if key in s)

    assert bound(comp["n"], "maximum") == 2 and bound(comp["logprobs"], "maximum") == 1
    assert bound(comp["max_tokens"], "maximum") == 6 and bound(comp["stop"], "maxItems") == 2


def test_a_chat_that_names_no_length_stops_at_the_served_limit(gpt2_dir):
    """server.limits.max_tokens bounds a chat without max_tokens too: the default "up to the context"
    ran past it (the fuzz test's chats generated to the end of a 96-token context under a limit of 8)."""
    with local_client(gpt2_dir, server={"limits": {"max_tokens": 6}}) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length", body
