"""A real two-node Ray cluster on one machine: `ray start --head` and `ray start --address` in their
own process groups (a private --temp-dir, so no other Ray session joins them), `shardserve serve
--address` with a TP=2 model whose two shard workers must land on different nodes (the head has
room for the replica and one shard only), then the worker node is killed (SIGKILL of its process
group): its in-flight request fails with 503, new requests fail fast with 5xx, and when a new node
joins, Ray Serve brings the replica back and requests succeed again."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import make_checkpoint

from training.distributed import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
SHARDSERVE = str(Path(sys.executable).with_name("shardserve"))


SLOW_PROBE_S = 5.0
"""Seconds between GCS probes while a starting node's `ray start` has not yet said it is up."""


class Cluster:
    """Ray nodes as process groups of `ray start --block`; `kill` is SIGKILL of a whole node."""

    def __init__(self, temp_dir: Path):
        self.temp_dir = temp_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "disabled"}  # a throwaway local cluster: no token files to share

    def start(self, name: str, cpus: int, head: bool = False) -> None:
        # its own free ports for what would take a fixed default (the dashboard agent's 52365, which the
        # suite's other Ray instances also want) and a small object store (nothing large travels here;
        # 30 % of memory per node, three nodes beside the suite's other Ray instances, is shm pressure)
        args = [RAY, "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
                f"--resources={{\"node_{name}\": 1}}", "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}", f"--object-store-memory={200 << 20}"]
        args += ([ "--head", f"--port={self.port}", "--include-dashboard=false", "--node-ip-address=127.0.0.1"]
                 if head else [f"--address={self.address}", "--node-ip-address=127.0.0.1"])
        log = open(self.temp_dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the node
        self.nodes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)

    def join(self, name: str, cpus: int, head: bool = False, timeout: float = 150, attempts: int = 3) -> float:
        """Start a node and wait until it is alive in the GCS; the seconds that took. Ray 2.60's raylet
        waits a fixed 15 s (no setting reaches it) for its dashboard agent to write its port files, and
        aborts ("Check failed ... Timed out waiting for file") where a loaded host starts the agent
        slower: CI's run on 315b0ed lost the replacement node that way. Only that abort starts the node
        again; any other failure to start fails the test."""
        t0 = time.monotonic()
        for attempt in range(1, attempts + 1):
            aborts = self._agent_port_aborts()
            self.start(name, cpus, head)
            deadline = time.monotonic() + timeout
            next_probe = time.monotonic() + SLOW_PROBE_S
            while time.monotonic() < deadline and self.nodes[name].poll() is None:
                # a probe is a driver process (import ray, connect: ~2 s of a core, 3-5 s at load), which took the
                # starting node's CPU: polled every 0.5 s, 7 probes per worker join (24-31 s at load 8). So probe
                # once the node's `ray start` says it is up (it prints that after its raylet is in the GCS), and
                # every SLOW_PROBE_S before that in case the line never shows
                if self._says_started(name) or time.monotonic() >= next_probe:
                    if self.node_alive(name):
                        return time.monotonic() - t0
                    next_probe = time.monotonic() + SLOW_PROBE_S
                time.sleep(0.25)
            if self.nodes[name].poll() is None:
                raise AssertionError(f"node {name} did not join (after {timeout} s)")
            self.kill(name)  # what the failed `ray start` left of its node
            if self._agent_port_aborts() == aborts:
                raise AssertionError(f"node {name}'s `ray start` exited before it joined")
            print(f"\nnode {name}: its raylet gave up waiting for its dashboard agent (attempt {attempt})",
                  file=sys.stderr)
        raise AssertionError(f"node {name}'s raylet aborted on its agent's port files {attempts} times")

    def _says_started(self, name: str) -> bool:
        """Whether the node's `ray start` printed "Ray runtime started." (Ray prints it once the node's raylet is
        registered in the GCS); a cheap local hint of when to ask the GCS, not a substitute for asking."""
        try:
            return "Ray runtime started" in (self.temp_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return False

    def _agent_port_aborts(self) -> int:
        return sum(f.read_text(errors="replace").count("Timed out waiting for file")
                   for f in self.temp_dir.glob("session_latest/logs/raylet*.out"))

    def node_alive(self, name: str) -> bool:
        """Whether the node started as `name` (its custom resource) is alive in the GCS."""
        words = self.probe(f"print('NODE_ALIVE', any(n['Alive'] and 'node_{name}' in n['Resources'] "
                           "for n in ray.nodes()))", "NODE_ALIVE")
        return words == ["True"]

    def logs(self, lines: int = 25) -> str:
        """The last lines of each node's own output, of `shardserve serve` and of Ray's raylet and GCS
        logs: a failure in CI shows where the time went without the temp dir (which CI does not keep)."""
        files = sorted(self.temp_dir.glob("*.log")) + sorted(self.temp_dir.glob("session_latest/logs/raylet*.out")) \
            + sorted(self.temp_dir.glob("session_latest/logs/gcs_server.out"))
        out = []
        for f in files:
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.relative_to(self.temp_dir)} (last {len(text)} lines)\n" + "\n".join(ln[:300] for ln in text))
        return "\n".join(out)

    def kill(self, name: str) -> None:
        p = self.nodes.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)

    def probe(self, body: str, marker: str) -> list[str] | None:
        """Run `body` in a driver joined to the cluster; the words it printed after `marker`, or None
        when the driver failed. The driver leaves by os._exit once it printed: a driver's disconnect
        from a loaded cluster can take longer than the question did (CI: "ALIVE_NODES 1" printed,
        then the process still running at the 60 s timeout)."""
        code = (f"import os, sys, ray, ray._private.state as st; ray.init(address='{self.address}', "
                f"logging_level='ERROR', log_to_driver=False)\n{body}\nsys.stdout.flush(); os._exit(0)")
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env, timeout=90)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0 or marker not in r.stdout:
            return None
        return _marked_line(r.stdout, marker)

    def shard_nodes(self) -> list[str]:
        """Node ids of the alive ShardWorker actors (from the GCS actor table: no dashboard here)."""
        words = self.probe("print('SHARD_NODES', ' '.join(a['Address']['NodeID'] for a in st.actors().values() "
                           "if a['ActorClassName'].endswith('ShardWorker') and a['State'] == 'ALIVE'))", "SHARD_NODES")
        assert words is not None, "the actor-table probe failed"
        return words

    def gateway_on_head(self) -> bool:
        """Whether every alive Gateway replica runs on the head node (it owns the HTTP port)."""
        words = self.probe("head = [n['NodeID'] for n in ray.nodes() if 'node:__internal_head__' in n['Resources']]\n"
                           "gw = [a['Address']['NodeID'] for a in st.actors().values() "
                           "if a['ActorClassName'].endswith('Gateway') and a['State'] == 'ALIVE']\n"
                           "print('GATEWAY_ON_HEAD', bool(gw) and all(g in head for g in gw))", "GATEWAY_ON_HEAD")
        return words == ["True"]

    def stop(self) -> None:
        for name in list(self.nodes):
            self.kill(name)


def _marked_line(stdout: str, marker: str) -> list[str]:
    """The words after `marker` on the one line that starts with it: Ray can print its own lines
    (a raylet's "node marked dead" notice) on a driver's stdout, around what the probe printed."""
    lines = [ln.split()[1:] for ln in stdout.splitlines() if ln.split()[:1] == [marker]]
    assert len(lines) == 1, f"expected one {marker} line in: {stdout[-2000:]}"
    return lines[0]


def wait_until(cond, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"{what} (after {timeout} s)")


def complete(url: str, max_tokens: int = 4, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"model": "tp2", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True})


def test_tp2_shards_on_two_nodes_survive_losing_a_node(tmp_path_factory):
    temp = Path(f"/tmp/w17-deploy-ray/{uuid.uuid4().hex[:8]}")  # short: Ray's socket paths have a length limit
    temp.mkdir(parents=True)
    model = make_checkpoint(tmp_path_factory.mktemp("gpt2-long"), "gpt2", n_positions=2048)
    cluster = Cluster(temp)
    cfg = tmp_path_factory.mktemp("cfg") / "tp2.yaml"
    server = None
    passed = False

    def ready() -> bool:
        if server.poll() is not None:  # its log is printed below
            raise AssertionError(f"shardserve serve exited ({server.returncode}) before it was ready")
        return _ok(url)

    try:
        cluster.join("head", cpus=2, head=True)  # the replica's bundle + one shard
        cluster.join("worker1", cpus=1)  # the other shard
        # the port chosen once the nodes run: chosen before them, a port one of their processes then took made the
        # server exit at start ("already in use", CI on c0a9160), and the wait below spent its 240 s on a dead server
        port = free_port()
        cfg.write_text(yaml.safe_dump({
            "models": [{"name": "tp2", "path": str(model), "num_cpus": 1, "shard_num_cpus": 1,
                        "engine": {"tensor_parallel_size": 2, "worker_threads": 1, "num_kv_blocks": 256,
                                   "cpu_linear_autotune": False, "dist_timeout_s": 20}}],
            "server": {"port": port, "log_requests": False, "drain_timeout_s": 2}}))
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([SHARDSERVE, "serve", "--config", str(cfg), "--address", cluster.address],
                                  stdout=open(temp / "serve.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                  env=cluster.env, start_new_session=True)
        wait_until(ready, "the server did not become ready", 240)
        assert complete(url).status_code == 200
        nodes = cluster.shard_nodes()
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"both shards on one node: {nodes}"
        assert cluster.gateway_on_head(), "a Gateway replica (it owns the port) is not on the head node"

        # a long request in flight while the worker node dies
        result: dict = {}

        def long_request():
            t0 = time.monotonic()
            try:
                result["r"] = complete(url, max_tokens=1900, timeout=120)
            except httpx.HTTPError as exc:  # a cut stream is also a failure the client sees
                result["exc"] = exc
            result["s"] = time.monotonic() - t0

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        killed = time.monotonic()
        cluster.kill("worker1")
        t.join(120)
        failed_after = time.monotonic() - killed
        assert "r" in result, result
        assert result["r"].status_code == 503, (result["r"].status_code, result["r"].text[:300])
        assert result["r"].json()["error"]["type"] == "service_unavailable"

        # a node joins again: Ray Serve replaces the replica and its placement group lands on it
        joined = time.monotonic()
        node_joined = cluster.join("worker2", cpus=1, timeout=120)
        wait_until(lambda: _ok(url) and complete(url).status_code == 200, "the replica did not recover", 150)
        assert len(set(cluster.shard_nodes())) == 2
        print(f"\ntwo-node: in-flight request failed with 503 {failed_after:.1f} s after the node was killed; "
              f"the new node joined after {node_joined:.1f} s; served again {time.monotonic() - joined:.1f} s "
              "after it was started")
        passed = True
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
        cluster.stop()
        if passed:
            shutil.rmtree(temp, ignore_errors=True)
        else:
            print(f"node and server logs kept in {temp}\n{cluster.logs()}", file=sys.stderr)


def _ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
