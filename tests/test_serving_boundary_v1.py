"""The /v1 boundary over real HTTP: a departed client's non-streaming generation is aborted, a
null or omitted max_tokens stays within server.limits.max_tokens, chat_template_kwargs cannot break
the chat renderer, and every error names a field the request has."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
from test_serving_app import MODEL, metric
from test_serving_faults import make_core, scrape, serve_http

from engines.transforms.ptuning import write_task_dir

LONG = {"model": MODEL, "prompt": "To be", "max_tokens": 240, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def _idle_within(c: httpx.AsyncClient, seconds: float) -> dict:
    t0 = time.monotonic()
    while True:
        m = await scrape(c)
        if (metric(m, "shardserve_num_requests_running", model=MODEL) == 0
                and metric(m, "shardserve_kv_cache_usage_ratio", model=MODEL) == 0):
            return m
        assert time.monotonic() - t0 < seconds, "the departed client's request still runs and holds KV blocks"
        await asyncio.sleep(0.02)


async def _running(c: httpx.AsyncClient, post: asyncio.Future) -> None:
    for _ in range(500):
        assert not post.done(), post.result().text
        if metric(await scrape(c), "shardserve_num_requests_running", model=MODEL) == 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never ran")


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", LONG),
                                            ("/v1/chat/completions", {**CHAT, "max_tokens": 200, "ignore_eos": True})])
def test_a_non_streaming_request_is_aborted_when_its_client_leaves(gpt2_dir, path, body):
    core = make_core(gpt2_dir, step_delay_s=0.05)  # 240 tokens: 12 s or more

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with httpx.AsyncClient(base_url=url, timeout=30) as leaver:
                post = asyncio.ensure_future(leaver.post(path, json=body))
                await _running(c, post)
                post.cancel()  # the client gives up: its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await post
            m = await _idle_within(c, 3)
            assert metric(m, "shardserve_requests_finished_total", finish_reason="abort") == 1
            assert metric(m, "shardserve_generation_tokens_total", model=MODEL) < body["max_tokens"]
            assert metric(m, "shardserve_http_requests_total", status="499") == 1
            r = await c.post(path, json={**body, "max_tokens": 2})  # the server serves on
            assert r.status_code == 200, r.text
        sched = core.engine.engine.scheduler
        assert sched.blocks.num_free == sched.cfg.num_blocks

    with serve_http(core) as (url, _):
        asyncio.run(main(url))


# max_tokens left out or null: the default (generation_config.json's max_new_tokens, else 16 for
# completions and the context for chats), at most server.limits.max_tokens; only a sent value is refused
CAP = 6
VIRTUAL = 20
"""Virtual tokens of the p-tuned task "soft" (they take context the gateway does not see)."""


@pytest.fixture(scope="module", params=["no_default", "default_over_cap"])
def capped(request, gpt2_dir, tmp_path_factory):
    """An openai client of a server with limits.max_tokens 6 (max_prompt_tokens 240, max_logprobs 1;
    context 256), whose model has a p-tuned
    task; with default_over_cap its generation_config.json says max_new_tokens 50."""
    d = tmp_path_factory.mktemp(request.param) / "gpt2"
    shutil.copytree(gpt2_dir, d)
    gen = d / "generation_config.json"
    if request.param == "default_over_cap":
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "max_new_tokens": 50}))
    table = np.random.default_rng(0).normal(0, 1.0, (VIRTUAL, 64)).astype(np.float32)
    write_task_dir(d / "ptuning" / "soft", "soft", table, base_model="x")
    with serve_http(make_core(d), limits={"max_tokens": CAP, "max_prompt_tokens": 240, "max_logprobs": 1}) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("sent", [{"max_tokens": None}, {}], ids=["null", "omitted"])
def test_a_completion_without_max_tokens_stops_at_the_limit(capped, sent):
    kw = {"model": MODEL, "prompt": "Once upon a time", "extra_body": {"ignore_eos": True}, **sent}
    r = capped.completions.create(**kw)
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"
    events = list(capped.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert events[-1].usage.completion_tokens == CAP
    assert len([e for e in events if e.choices]) <= CAP


@pytest.mark.parametrize("task", [None, "soft"])
def test_a_chat_without_max_tokens_stops_at_the_limit(capped, task):
    r = capped.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ignore_eos": True, "task": task})
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"


def test_a_task_prompt_near_the_context_end_runs_to_the_context(capped):
    """The gateway cannot see the task's virtual tokens: the limit it picks for a prompt that leaves
    room for it (232 + 6 <= 256) does not fit beside them (252 + 6), and the context ends first."""
    r = capped.completions.create(model=MODEL, prompt=[5] * 232, extra_body={"ignore_eos": True, "task": "soft"})
    assert r.usage.completion_tokens == 256 - 232 - VIRTUAL and r.choices[0].finish_reason == "length"


def test_each_prompt_of_a_batch_takes_the_limit_or_its_own_context_end(capped):
    """One unset max_tokens, prompts of 232 and 3 tokens after the task's 20 virtual ones: the long one runs to the
    context (4 tokens), the short one stops at the limit (it ran on to the context while the longest prompt decided
    for the batch)."""
    r = capped.completions.create(model=MODEL, prompt=[[5] * 232, [5] * 3],
                                  extra_body={"ignore_eos": True, "task": "soft"})
    got = {c.index: c for c in r.choices}
    assert r.usage.completion_tokens == (256 - 232 - VIRTUAL) + CAP, r.usage
    assert got[0].finish_reason == got[1].finish_reason == "length"


def test_a_v2_request_without_max_tokens_takes_the_limit(capped):
    """/v2 takes the same resolved length: its fallback of 16 over a limit of 6 refused every request that set none."""
    url = str(capped.base_url).removesuffix("/v1/").removesuffix("/v1")
    r = httpx.post(f"{url}/v2/models/{MODEL}/generate", json={"text_input": "Once upon a time",
                                                             "parameters": {"ignore_eos": True}}, timeout=30)
    assert r.status_code == 200 and r.json()["finish_reason"] == "length", r.text
    r = httpx.post(f"{url}/v2/models/{MODEL}/generate", json={"text_input": "hi", "max_tokens": CAP + 1}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"], r.text


def test_a_sent_max_tokens_over_the_limit_is_refused(capped):
    for call in (lambda: capped.completions.create(model=MODEL, prompt="hi", max_tokens=CAP + 1),
                 lambda: capped.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=CAP + 1)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "max_tokens" and f"at most {CAP}" in e.value.body["message"]


@pytest.fixture(scope="module")
def plain(gpt2_dir):
    """An openai client of a server without limits."""
    with serve_http(make_core(gpt2_dir)) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body=extra)


def _refused(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    return e.value.body


def test_chat_template_kwargs_may_set_add_generation_prompt(plain):
    """As vLLM: chat_template_kwargs reach the template after the request's own variables, so
    add_generation_prompt may be given there too (it was a 500: two values for one argument)."""
    asked = _chat(plain).usage.prompt_tokens
    bare = _chat(plain, add_generation_prompt=False).usage.prompt_tokens
    assert bare < asked
    assert _chat(plain, chat_template_kwargs={"add_generation_prompt": False}).usage.prompt_tokens == bare
    assert _chat(plain, chat_template_kwargs={"template": "x", "custom": [1]}).usage.prompt_tokens == asked
    body = _refused(lambda: _chat(plain, add_generation_prompt=True, chat_template_kwargs={
        "add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt")
    assert "add_generation_prompt" in body["message"]
    _refused(lambda: _chat(plain, chat_template_kwargs={"add_generation_prompt": "no"}),
             "chat_template_kwargs.add_generation_prompt")


@pytest.mark.parametrize("key", ["messages", "bos_token", "eos_token", "raise_exception"])
def test_chat_template_kwargs_cannot_replace_what_the_server_sets(plain, key):
    body = _refused(lambda: _chat(plain, chat_template_kwargs={key: "x"}), f"chat_template_kwargs.{key}")
    assert f"chat_template_kwargs.{key}" in body["message"]


# errors name the field of the request that carries the refused value
def test_chat_limit_errors_name_the_chats_fields(capped):
    long = [{"role": "user", "content": "hi " * 300}]
    body = _refused(lambda: capped.chat.completions.create(model=MODEL, messages=long, max_tokens=2), "messages")
    assert body["message"].startswith("messages: ") and "max_prompt_tokens" in body["message"]
    body = _refused(lambda: _chat(capped, max_tokens=None, max_completion_tokens=CAP + 1), "max_completion_tokens")
    assert body["message"].startswith("max_completion_tokens: at most")
    body = _refused(lambda: _chat(capped, logprobs=True, top_logprobs=2), "top_logprobs")
    assert body["message"].startswith("top_logprobs: at most 1")


def test_engine_errors_name_the_requests_fields(plain):
    long = [{"role": "user", "content": "hi " * 400}]
    body = _refused(lambda: plain.chat.completions.create(model=MODEL, messages=long, max_tokens=2), "messages")
    assert body["message"].startswith("messages: ") and body["code"] == "context_length_exceeded"
    body = _refused(lambda: _chat(plain, max_tokens=None, max_completion_tokens=250), "max_completion_tokens")
    assert body["message"].startswith("max_completion_tokens: ") and body["code"] == "context_length_exceeded"
    body = _refused(lambda: plain.completions.create(model=MODEL, prompt=[[1, 2], [3, 99999]], max_tokens=2),
                    "prompt[1]")
    assert body["message"].startswith("prompt[1]: token id 99999 at position 1") and body["code"] == "invalid_token_id"


def test_a_compressed_v1_body_is_inflated(plain):
    """Content-Encoding is undone for /v1 as for /v2 (a gzip body was 'not valid JSON'); an unknown one is a 415."""
    import gzip
    import zlib

    url = str(plain.base_url).rstrip("/")
    body = json.dumps({"model": MODEL, "prompt": "To be", "max_tokens": 2, "temperature": 0}).encode()
    want = httpx.post(f"{url}/completions", content=body, timeout=30).json()["choices"][0]["text"]
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        r = httpx.post(f"{url}/completions", content=data, headers={"content-encoding": enc}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (enc, r.text)
    r = httpx.post(f"{url}/completions", content=body, headers={"content-encoding": "br"}, timeout=30)
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"], r.text
