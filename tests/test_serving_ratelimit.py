"""Per-key rate limits (serving/ratelimit.py, server.rate_limit_* in deploy/schema.py): requests per
second and concurrent streams per API key, 429 with Retry-After beyond; other keys unaffected.
Through a live uvicorn server with the real engine on a tiny model."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from conftest import make_checkpoint

from deploy.schema import validate_config
from serving.app import create_local_app
from serving.ratelimit import KeyLimiter
from training.distributed import free_port


def test_token_bucket_and_concurrency_per_key():
    lim = KeyLimiter(rps=2.0, burst=3, max_concurrent=None)
    assert [lim.acquire("a", now=0.0) for _ in range(3)] == [None] * 3
    reason, retry = lim.acquire("a", now=0.0)
    assert "2 requests per second" in reason and retry == 1
    assert lim.acquire("b", now=0.0) is None  # another key has its own bucket
    assert lim.acquire("a", now=0.5) is None  # 0.5 s x 2/s refilled one request
    assert lim.acquire("a", now=0.5) is not None
    lim = KeyLimiter(rps=None, burst=1, max_concurrent=2)
    assert lim.acquire("a") is None and lim.acquire("a") is None
    assert "2 concurrent" in lim.acquire("a")[0]
    lim.release("a")
    assert lim.acquire("a") is None


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # 2,048 positions: a long stream stays open for a while
    model = make_checkpoint(tmp_path_factory.mktemp("gpt2-long"), "gpt2", n_positions=2048)
    cfg = validate_config({
        "models": [{"name": "gpt2", "path": str(model),
                    "engine": {"num_kv_blocks": 256, "max_num_seqs": 8, "cpu_linear_autotune": False}}],
        # 0.02/s: a token back after 50 s; at 0.5/s a CI run's three burst requests outlasted the 2 s refill
        "server": {"log_requests": False, "rate_limit_rps": 0.02, "rate_limit_burst": 3,
                   "max_concurrent_per_key": 1}})
    server = uvicorn.Server(uvicorn.Config(create_local_app(cfg, api_keys=["k1", "k2", "k3"]), host="127.0.0.1",
                                          port=free_port(), log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def post(url, key, **body):
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "gpt2", "prompt": "hi", "max_tokens": 2, **body})


def test_requests_per_second_per_key(url):
    codes = [post(url, "k1").status_code for _ in range(3)]
    assert codes == [200, 200, 200]  # the burst
    r = post(url, "k1")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["Retry-After"]) >= 1
    assert post(url, "k2").status_code == 200  # another key is not limited by k1's traffic
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200  # not generation


def test_concurrent_streams_per_key(url):
    with httpx.Client(timeout=60, headers={"Authorization": "Bearer k3"}) as c, c.stream(
            "POST", f"{url}/v1/completions", json={"model": "gpt2", "prompt": "hi", "max_tokens": 1900,
                                                    "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        first = next(lines)  # the stream is open and running
        assert first.startswith("data: ")
        r = post(url, "k3")
        assert r.status_code == 429 and "concurrent" in r.json()["error"]["message"]
    # the client left mid-stream: the server aborts it and the key's slot is freed
    deadline = time.monotonic() + 20
    while (code := post(url, "k3").status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert code == 200
