"""The ingress modes of the gateway (server.ingress): `direct`, where Gateway replicas serve HTTP
themselves (two of them sharing the port), `ray-proxy`, behind Ray Serve's HTTP proxy, and
`colocated`, where the model's one replica serves the routes itself (no Gateway, no metrics hub);
and a taken port refused before Ray starts, naming the field."""

from __future__ import annotations

import shutil
import socket
import subprocess

import httpx
import pytest

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

from deploy.schema import ConfigFileError, validate_config
from serving import launcher
from training.distributed import free_port


def config(gpt2_dir, port: int, **server):
    return validate_config({
        "models": [{"name": "gpt2", "path": str(gpt2_dir), "replicas": 1, "num_cpus": 1,
                    "engine": {"num_kv_blocks": 128, "cpu_linear_autotune": False}}],
        "server": {"port": port, "log_requests": False, "drain_timeout_s": 1, **server},
    })


def listeners(port: int) -> list[str]:
    if shutil.which("ss") is None:
        pytest.skip("`ss` (iproute2) is needed to see which processes listen")
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_taken_port_is_refused_before_ray_starts(gpt2_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigFileError, match=rf"server.port: 127.0.0.1:{port} is already in use"):
            launcher.start(config(gpt2_dir, port), api_keys=[])
    assert not ray.is_initialized()


@pytest.mark.parametrize("ingress, gateways", [("direct", 2), ("ray-proxy", 1), ("colocated", 1)])
def test_ingress_modes_serve_the_same_api(gpt2_dir, ingress, gateways):
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    running = launcher.start(config(gpt2_dir, port, ingress=ingress, gateway_replicas=gateways), api_keys=[])
    try:
        from openai import OpenAI

        with OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            texts = {client.completions.create(model="gpt2", prompt="To be", max_tokens=6, temperature=0).choices[0].text
                     for _ in range(6)}  # over both gateways when there are two
        assert len(texts) == 1
        (texts_seen,) = texts
        assert texts_seen
        r = httpx.get(f"{running.url}/v2/health/ready", headers={"X-Request-Id": "abc-123"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        r = httpx.post(f"{running.url}/v1/completions", json={"model": "gpt2", "prompt": "x", "max_tokens": 0},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        procs = " ".join(listeners(port))
        if ingress == "direct":  # each gateway replica listens itself; no Ray proxy
            assert procs.count("ServeRepli") == gateways and "ProxyActor" not in procs, procs
        elif ingress == "colocated":  # the model's replica listens; no Gateway, no hub, no proxy
            assert procs.count("ServeRepli") == 1 and "ProxyActor" not in procs, procs
            # Serve's replicas are named actors: SERVE_REPLICA::<app>#<deployment>#<id>
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
            assert not [n for n in names if "#Gateway#" in n or "#MetricsHub#" in n], names
            assert [n for n in names if "#ModelServer:gpt2#" in n], names
            with OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                pieces = [c.choices[0].text for c in client.completions.create(
                    model="gpt2", prompt="To be", max_tokens=6, temperature=0, stream=True)]
            assert "".join(pieces) == texts_seen, pieces  # streamed = unstreamed, token for token
            metrics = httpx.get(f"{running.url}/metrics", timeout=30).text  # the model's and the gateway's
            assert "shardserve_generation_tokens_total" in metrics and "shardserve_http_requests_total" in metrics
        else:
            assert "ServeRepli" not in procs, procs
    finally:
        launcher.stop(running)
    assert not listeners(port), "the port is still taken after stop"
