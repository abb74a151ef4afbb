"""Load and faults, in-process over real HTTP (uvicorn on 127.0.0.1): admission limits (429),
client disconnects (abort, KV blocks freed), per-request timeouts (408), engine failure (503 and
an unhealthy replica), and graceful drain on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from test_serving_app import MODEL, metric, parse_metrics

from deploy.schema import validate_config
from engines.core.async_engine import EngineDeadError
from serving.app import create_local_app
from serving.model_core import ModelCore

LONG = {"model": MODEL, "prompt": "To be", "max_tokens": 240, "ignore_eos": True}


def make_core(model_dir, step_delay_s: float = 0.0, request_timeout_s: float = 600.0, **spec) -> ModelCore:
    spec = {"engine": {"num_kv_blocks": 128, "max_num_seqs": 4, "cpu_linear_autotune": False}, "max_waiting": 4,
            **spec}
    cfg = validate_config({"models": [{"name": MODEL, "path": str(model_dir), **spec}]})
    core = ModelCore.load(cfg.models[0], request_timeout_s=request_timeout_s)
    if step_delay_s:
        executor = core.engine.engine.executor
        execute = executor.execute

        def slow_execute(plan):
            time.sleep(step_delay_s)  # a slower model: makes timings deterministic on any machine
            return execute(plan)
        executor.execute = slow_execute
    return core


@contextlib.contextmanager
def serve_http(core: ModelCore, **server):
    """The in-process app on a real uvicorn server at 127.0.0.1:<ephemeral>, in a thread."""
    cfg = validate_config({"models": [{"name": MODEL, "path": "unused"}],
                           "server": {"log_requests": False, "drain_timeout_s": 5, **server}})
    with uvicorn_thread(create_local_app(cfg, cores={MODEL: core})) as served:
        yield served


@contextlib.contextmanager
def uvicorn_thread(app, log_level: str = "warning"):
    """(url, server) of any ASGI app on a real uvicorn server at 127.0.0.1:<ephemeral>, in a thread, until exit."""
    server_ = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server_.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server_.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server_.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server_
    finally:
        server_.should_exit = True
        thread.join(timeout=30)


async def first_event(resp: httpx.Response) -> dict:
    async for line in resp.aiter_lines():
        if line.startswith("data: {"):
            return json.loads(line[6:])
    raise AssertionError("stream ended without an event")


async def scrape(client: httpx.AsyncClient) -> dict:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def test_admission_limit_gives_429_with_retry_after(gpt2_dir):
    # capacity = max_num_seqs 2 + max_waiting 1 = 3 sequences
    core = make_core(gpt2_dir, step_delay_s=0.01, engine={"num_kv_blocks": 128, "max_num_seqs": 2,
                                                           "cpu_linear_autotune": False},
                     max_waiting=1, retry_after_s=3)

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c, contextlib.AsyncExitStack() as stack:
            for _ in range(3):  # two run, one waits; a streaming response starts once admitted
                r = await stack.enter_async_context(c.stream("POST", "/v1/completions", json={**LONG, "stream": True}))
                assert r.status_code == 200
            assert core.admitted == 3
            r = await c.post("/v1/completions", json={**LONG, "max_tokens": 4})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "3"
            err = r.json()["error"]
            assert err["code"] == "server_overloaded" and err["type"] == "rate_limit_error"
            m = await scrape(c)
            assert metric(m, "shardserve_requests_rejected_total", reason="overloaded") == 1
            assert metric(m, "shardserve_http_requests_total", status="429") == 1
        # once they are gone, there is room again
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for _ in range(100):
                r = await c.post("/v1/completions", json={**LONG, "max_tokens": 2})
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 200

    with serve_http(core) as (url, _):
        asyncio.run(main(url))


def test_disconnect_aborts_and_frees_kv_blocks(gpt2_dir):
    core = make_core(gpt2_dir, step_delay_s=0.02)

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                await first_event(r)
                busy = await scrape(c)
                assert metric(busy, "shardserve_kv_cache_usage_ratio", model=MODEL) > 0
                assert metric(busy, "shardserve_num_requests_running", model=MODEL) == 1
            t0 = time.monotonic()  # the stream is closed: the client is gone
            while True:
                m = await scrape(c)
                if (metric(m, "shardserve_kv_cache_usage_ratio", model=MODEL) == 0
                        and metric(m, "shardserve_num_requests_running", model=MODEL) == 0):
                    break
                assert time.monotonic() - t0 < 5, "the aborted request still holds KV blocks"
                await asyncio.sleep(0.01)
            assert metric(m, "shardserve_requests_finished_total", finish_reason="abort") == 1
            assert metric(m, "shardserve_generation_tokens_total", model=MODEL) < LONG["max_tokens"]
        assert core.engine.engine.scheduler.blocks.num_free == core.engine.engine.scheduler.cfg.num_blocks

    with serve_http(core) as (url, _):
        asyncio.run(main(url))


def test_request_timeout_gives_408_and_frees_blocks(gpt2_dir):
    core = make_core(gpt2_dir, step_delay_s=0.02, request_timeout_s=0.3)

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=LONG)
            assert r.status_code == 408, r.text
            assert r.json()["error"]["code"] == "request_timeout"
            assert time.monotonic() - t0 < 3
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
            assert lines[-1] == "data: [DONE]"
            m = await scrape(c)
            assert metric(m, "shardserve_requests_finished_total", finish_reason="timeout") == 2
            assert metric(m, "shardserve_kv_cache_usage_ratio", model=MODEL) == 0

    with serve_http(core) as (url, _):
        asyncio.run(main(url))


def test_engine_failure_gives_503_and_replica_reports_unhealthy(gpt2_dir):
    core = make_core(gpt2_dir, step_delay_s=0.01)
    execute = core.engine.engine.executor.execute
    calls = {"n": 0}

    def failing_execute(plan):
        calls["n"] += 1
        if calls["n"] > 20:
            raise RuntimeError("simulated device failure")
        return execute(plan)
    core.engine.engine.executor.execute = failing_execute

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/v1/completions", json=LONG)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "engine_unavailable" and "simulated device failure" in err["message"]
            r = await c.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/v2/health/ready")).status_code == 503
            assert (await c.get("/v2/health/live")).status_code == 200  # the process is alive
        with pytest.raises(EngineDeadError):
            core.check_health()  # what Ray Serve calls: the replica gets replaced

    with serve_http(core) as (url, _):
        asyncio.run(main(url))


def test_graceful_drain_finishes_in_flight_requests(gpt2_dir):
    core = make_core(gpt2_dir, step_delay_s=0.005)

    async def main():
        results = {}

        async def long_request():
            from engines import SamplingParams
            from serving.wire import GenerateRequest

            req = GenerateRequest("drain-1", [[5, 6, 7]], SamplingParams(max_tokens=60, ignore_eos=True))
            chunks = [c async for c in core.generate(req)]
            results["last"] = chunks[-1]

        task = asyncio.create_task(long_request())
        while core.active_requests == 0:
            await asyncio.sleep(0.005)
        shutdown = asyncio.create_task(core.shutdown(drain_timeout_s=10))
        await asyncio.sleep(0.01)
        from engines import SamplingParams
        from serving.wire import GenerateRequest

        refused = [c async for c in core.generate(GenerateRequest("late", [[5]], SamplingParams(max_tokens=2)))]
        assert refused[0].error.status == 503 and "shutting down" in refused[0].error.message
        await task
        await shutdown
        last = results["last"]
        assert last.error is None and last.usage == (3, 60)
        assert not core.engine._thread.is_alive()

    asyncio.run(main())


def test_drain_timeout_aborts_what_is_left(gpt2_dir):
    core = make_core(gpt2_dir, step_delay_s=0.02)

    async def main():
        from engines import SamplingParams
        from serving.wire import GenerateRequest

        async def consume():
            return [c async for c in core.generate(GenerateRequest("slow", [[5, 6]],
                                                                   SamplingParams(max_tokens=200, ignore_eos=True)))]
        task = asyncio.create_task(consume())
        while core.active_requests == 0:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        await core.shutdown(drain_timeout_s=0.2)
        chunks = await asyncio.wait_for(task, 10)
        assert time.monotonic() - t0 < 5
        assert chunks[-1].finished and chunks[-1].error is not None and chunks[-1].error.status == 503

    asyncio.run(main())
