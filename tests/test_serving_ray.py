"""End to end through Ray Serve: a Gateway, ModelServer replicas (2 of the main model), and the
official clients (`openai`, `tritonclient.http`) over HTTP on 127.0.0.1.

One Ray session for the module (starting Ray is the slow part). Models:
  gpt2        2 replicas, room for 2 x (16 running + 64 waiting) sequences
  tight       1 replica, 2 running + 1 waiting: the admission limit is easy to reach (its own
              checkpoint with 2,048 positions, so that a long request stays in flight for seconds)
  gpt2-tp2    1 replica whose engine is split over 2 shard-worker actors (tensor parallel)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

from conftest import make_checkpoint
from test_serving_app import metric, parse_metrics

from deploy.schema import validate_config
from serving import launcher
from training.distributed import free_port

ENGINE = {"num_kv_blocks": 512, "cpu_linear_autotune": False}
LONG = 2000  # tokens of a request that must still be running when the test acts on it


@pytest.fixture(scope="module")
def url(gpt2_dir, tmp_path_factory):
    long_dir = make_checkpoint(tmp_path_factory.mktemp("gpt2-long"), "gpt2", n_positions=LONG + 48)
    if ray.is_initialized():  # another module's session: start clean
        ray.shutdown()
    cfg = validate_config({
        "models": [
            {"name": "gpt2", "path": str(gpt2_dir), "replicas": 2, "num_cpus": 1,
             "engine": {**ENGINE, "max_num_seqs": 16}, "max_waiting": 64},
            {"name": "tight", "path": str(long_dir), "replicas": 1, "num_cpus": 1,
             "engine": {**ENGINE, "max_num_seqs": 2}, "max_waiting": 1, "retry_after_s": 2},
            {"name": "gpt2-tp2", "path": str(gpt2_dir), "replicas": 1, "num_cpus": 1, "shard_num_cpus": 1,
             "engine": {**ENGINE, "tensor_parallel_size": 2, "worker_threads": 1}},
        ],
        "server": {"port": free_port(), "log_requests": False, "metrics_push_interval_s": 0.2,
                   "drain_timeout_s": 5},
    })
    running = launcher.start(cfg, api_keys=[])
    try:
        yield running.url
    finally:
        launcher.stop(running)


@pytest.fixture
def openai_client(url):
    from openai import OpenAI

    with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def scrape(url: str) -> dict:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def wait_for(url: str, ready, what: str, timeout: float = 30) -> dict:
    """Scrape until `ready(metrics)` holds (the replicas publish every 0.2 s, through Ray calls
    that a busy machine may delay); fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if ready(m):
            return m
        assert time.monotonic() < deadline, f"{what} (after {timeout:g} s)"
        time.sleep(0.1)


def settled(url: str, value, timeout: float = 30) -> dict:
    """A scrape once `value(metrics)` has stopped moving: the same in two scrapes 1 s apart (five
    publishing intervals), so that late counts of earlier requests are in."""
    prev = scrape(url)
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(1.0)
        m = scrape(url)
        if value(m) == value(prev):
            return m
        assert time.monotonic() < deadline, "the metrics never settled"
        prev = m


def test_every_ray_replica_reports_its_steps(url):
    """GET /v1/admin/steps gathers every replica's latest engine steps, a TP2 replica's with its
    layout. First in the module: the gpt2 replicas have run no request before these 8."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for model in ("gpt2", "gpt2-tp2"):
            for _ in range(8):  # Ray's router spreads these over both replicas of gpt2
                r = c.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 3,
                                                    "ignore_eos": True})
                assert r.status_code == 200, r.text
        deadline, reps = time.monotonic() + 10, []
        while time.monotonic() < deadline:  # published every 0.2 s
            reps = c.get("/v1/admin/steps", params={"model": "gpt2"}).json()["data"]
            if len(reps) == 2 and sum(len(w["steps"]) for w in reps) == 8 * 3:
                break
            time.sleep(0.2)
        assert len(reps) == 2 and len({w["replica"] for w in reps}) == 2
        assert sum(len(w["steps"]) for w in reps) == 8 * 3  # 8 requests: a prefill and 2 decodes each
        tp2 = c.get("/v1/admin/steps", params={"model": "gpt2-tp2"}).json()["data"]
        assert len(tp2) == 1 and tp2[0]["layout"]["tensor_parallel_size"] == 2 and tp2[0]["steps"]


def test_a_start_past_its_limit_names_the_deployment_still_starting(url):
    """serve.run waits for an application's replicas without a limit (a start hung CI on 380a0aa without a
    word); the launcher's wait (server.start_timeout_s) fails at its deadline naming each deployment still
    starting and its replicas' states. A real replica whose constructor does not return, beside the served app."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=0)
    class SlowStart:
        def __init__(self):
            time.sleep(300)

        def __call__(self, request):
            return "never"

    t0 = time.monotonic()
    serve.run_many([serve.RunTarget(SlowStart.bind(), name="slow-start", route_prefix="/slow-start")],
                   wait_for_applications_running=False)
    try:
        with pytest.raises(launcher.StartTimeout, match=r"did not start in \d+ s \(server\.start_timeout_s\): "
                                                         r"SlowStart: updating \(1 starting\)"):
            launcher.wait_running("slow-start", time.monotonic() + 3, since=t0)
    finally:
        serve.delete("slow-start")
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the served app never noticed


def test_openai_client_completions(openai_client):
    out = openai_client.completions.create(model="gpt2", prompt="To be, or not", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    chunks = list(openai_client.completions.create(model="gpt2", prompt="To be, or not", max_tokens=8,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    many = openai_client.completions.create(model="gpt2", prompt=["a", "b"], max_tokens=3, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]


def test_replicas_keep_the_callers_priority(url):
    """The embedded Ray starts its workers at the caller's nice value, not Ray's default 15 (at 15
    any nice-0 process on the host takes the engine's cores). Replicas are found by the process
    title Ray gives them (`ray::ServeReplica:<app>:<deployment>`)."""
    import os
    from pathlib import Path

    replicas = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.startswith("ray::ServeReplica"):
                replicas[f"{title} ({proc.name})"] = os.getpriority(os.PRIO_PROCESS, int(proc.name))
    assert len(replicas) >= 5, replicas  # ModelServer 2 + 1 + 1, the Gateway, shard actors aside
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert replicas == dict.fromkeys(replicas, mine)


def test_openai_client_chat(openai_client):
    messages = [{"role": "user", "content": "Hello"}]
    out = openai_client.chat.completions.create(model="gpt2", messages=messages, max_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 6
    stream = openai_client.chat.completions.create(model="gpt2", messages=messages, max_tokens=6, temperature=0,
                                                   stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content
    assert [m.id for m in openai_client.models.list().data] == ["gpt2", "tight", "gpt2-tp2"]


def test_openai_client_sees_errors(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.completions.create(model="gpt2", prompt="x", max_tokens=100_000)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="nope", prompt="x")


def test_tritonclient_health_metadata_infer(url):
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("gpt2")
    meta = client.get_model_metadata("gpt2")
    assert meta["name"] == "gpt2" and meta["outputs"][0]["name"] == "text_output"
    assert client.get_server_metadata()["name"] == "shardserve"
    want = httpx.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": "To be", "max_tokens": 6,
                                                     "temperature": 0}).json()["choices"][0]["text"]
    for binary in (True, False):
        text = triton.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"To be"], dtype=np.object_), binary_data=binary)
        out = triton.InferRequestedOutput("text_output", binary_data=binary)
        result = client.infer("gpt2", [text], outputs=[out], parameters={"max_tokens": 6, "temperature": 0})
        got = result.as_numpy("text_output")[0]
        assert (got.decode() if isinstance(got, bytes) else got) == want
    client.close()


def test_generate_stream_and_request_id(url):
    with httpx.stream("POST", f"{url}/v2/models/gpt2/generate_stream", json={"text_input": "To be", "max_tokens": 5},
                      headers={"X-Request-Id": "ray-trace-1"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "ray-trace-1"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1]["finish_reason"] == "length"


def test_100_concurrent_streams_complete(url):
    from openai import AsyncOpenAI

    async def main():
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            async def one(i: int):
                stream = await client.completions.create(model="gpt2", prompt=f"request {i}:", max_tokens=12,
                                                         stream=True, extra_body={"ignore_eos": True})
                text, finish = "", None
                async for chunk in stream:
                    for c in chunk.choices:
                        text += c.text
                        finish = c.finish_reason or finish
                return text, finish
            return await asyncio.gather(*[one(i) for i in range(100)], return_exceptions=True)

    def tokens(m: dict) -> float:
        return metric(m, "shardserve_generation_tokens_total", model="gpt2")

    before = settled(url, tokens)  # earlier tests' counts are in
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(finish == "length" for _, finish in results)
    wait_for(url, lambda m: tokens(m) - tokens(before) >= 100 * 12, "the 1,200 tokens were not all counted")
    after = settled(url, tokens)
    replicas = {dict(ls)["replica"] for (n, ls) in after if n == "shardserve_generation_tokens_total"
                and dict(ls).get("model") == "gpt2"}
    assert len(replicas) == 2, "both replicas report metrics"
    gained = [metric(after, "shardserve_generation_tokens_total", model="gpt2", replica=r)
              - metric(before, "shardserve_generation_tokens_total", model="gpt2", replica=r) for r in replicas]
    assert sum(gained) == 100 * 12
    assert all(g > 0 for g in gained), f"Ray Serve spread the load over both replicas: {gained}"


def test_admission_limit_gives_429(url):
    body = {"model": "tight", "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c, contextlib.AsyncExitStack() as stack:
            for _ in range(3):  # 2 running + 1 waiting fill the replica
                r = await stack.enter_async_context(c.stream("POST", "/v1/completions", json=body))
                assert r.status_code == 200
            r = await c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "server_overloaded"

    asyncio.run(main())


def test_disconnected_stream_frees_its_kv_blocks(url):
    body = {"model": "tight", "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    def aborts(m: dict) -> float:
        return metric(m, "shardserve_requests_finished_total", model="tight", finish_reason="abort")

    # the 429 test's streams: wait until they are gone and their aborts are all counted
    wait_for(url, lambda m: metric(m, "shardserve_num_sequences_admitted", model="tight") == 0,
             "the previous test's requests never ended")
    before = settled(url, aborts)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token in, the client hangs up
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        aborted = aborts(m) - aborts(before)
        if (aborted == 1 and metric(m, "shardserve_kv_cache_usage_ratio", model="tight") == 0
                and metric(m, "shardserve_num_requests_running", model="tight") == 0):
            break
        assert time.monotonic() - t0 < 10, ("the disconnected request was not aborted, or still holds KV blocks", aborted, metric(m, "shardserve_kv_cache_usage_ratio", model="tight"), metric(m, "shardserve_num_requests_running", model="tight"))
        time.sleep(0.05)
    generated = (metric(m, "shardserve_generation_tokens_total", model="tight")
                 - metric(before, "shardserve_generation_tokens_total", model="tight"))
    assert generated < LONG, "the request ran to the end although its client had left"


def test_tensor_parallel_replica_matches_single_device(openai_client):
    kw = {"prompt": "Whether 'tis nobler", "max_tokens": 10, "temperature": 0}
    one = openai_client.completions.create(model="gpt2", **kw).choices[0].text
    tp2 = openai_client.completions.create(model="gpt2-tp2", **kw).choices[0].text
    assert tp2 == one


def test_metrics_report_every_replica_and_gateway(url):
    def ttft_counts(m: dict) -> list[float]:
        return [metric(m, "shardserve_time_to_first_token_seconds_count", model=model)
                for model in ("gpt2", "tight", "gpt2-tp2")]

    m = wait_for(url, lambda m: all(ttft_counts(m)), "a model's replica never published its metrics")
    for model in ("gpt2", "tight", "gpt2-tp2"):
        assert metric(m, "shardserve_time_to_first_token_seconds_count", model=model) > 0, model
        assert any(n == "shardserve_kv_cache_usage_ratio" and dict(ls)["model"] == model for n, ls in m), model
    assert metric(m, "shardserve_http_requests_total", route="/v1/completions", status="429") >= 1
    assert metric(m, "shardserve_http_requests_total", route="/v1/completions", status="200") >= 100


def test_grafana_dashboard_queries_name_exported_metrics(url):
    """Every metric and label the Grafana dashboard queries exists on this live server's /metrics."""
    from test_deploy_files import dashboard_exprs

    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": "dashboard", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    m = wait_for(url, lambda m: metric(m, "shardserve_http_requests_total", status="200") >= 1
                 and metric(m, "shardserve_time_to_first_token_seconds_count", model="gpt2") > 0, "no metrics yet")
    labels: dict[str, set[str]] = {}
    for name, ls in m:
        labels.setdefault(name, set()).update(k for k, _ in ls)
    checked = set()
    for expr in dashboard_exprs():
        selectors = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)
        bare = re.findall(r"\b(shardserve_[a-zA-Z0-9_]+)\b", expr)
        assert bare and {n for n, _ in selectors} <= set(bare), expr  # no selector outside our metrics
        seen = set()
        for name in bare:
            assert name in labels, f"{name} (in {expr!r}) is not exported"
            seen |= labels[name]
            checked.add(name)
        for _, matchers in selectors:
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in seen, (label, expr)
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert label in seen, (label, expr)
    assert len(checked) >= 10, checked
