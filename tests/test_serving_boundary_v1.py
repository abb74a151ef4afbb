"""The /v1 boundary over real HTTP: a departed client's non-streaming generation is aborted, a
null or omitted max_tokens stays within server.limits.max_tokens, chat_template_kwargs cannot break
the chat renderer, and every error names a field the request has."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from test_serving_app import MODEL, metric
from test_serving_faults import make_core, scrape, serve_http

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
