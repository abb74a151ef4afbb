"""The tuner's server runner (tuner/server.py) starts again on a fresh port when the one it chose is taken before the
server binds it (free_port lets it go first), and only then."""

from __future__ import annotations

import socket

import pytest
import yaml

import tuner.server as ts


def test_a_taken_port_is_retried_on_fresh_ones(gpt2_dir, tmp_path, monkeypatch):
    held = []
    for _ in range(ts.PORT_TRIES):  # every port the runner will be handed is taken, as a racing process would take it
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    ports = [s.getsockname()[1] for s in held]
    handed = iter(ports)
    monkeypatch.setattr(ts, "free_port", lambda: next(handed))
    conf = tmp_path / "serve.yaml"
    conf.write_text(yaml.safe_dump({"models": [{"name": "gpt2", "path": str(gpt2_dir), "num_cpus": 1,
                                                 "engine": {"num_kv_blocks": 64, "cpu_linear_autotune": False}}]}))
    server = ts.Server(["--config", str(conf)], tmp_path / "serve.log", startup_timeout_s=120)
    try:
        with pytest.raises(ts.ServeError, match="already in use"), server:
            pass
    finally:
        for s in held:
            s.close()
    assert server.ports == ports  # one start a port, PORT_TRIES in all
    log = (tmp_path / "serve.log").read_text()
    assert all(f"127.0.0.1:{p} is already in use" in log for p in ports)  # each start's error kept in the log


def test_other_start_errors_are_not_retried(tmp_path, monkeypatch):
    handed = iter([ts.free_port(), ts.free_port()])
    monkeypatch.setattr(ts, "free_port", lambda: next(handed))
    server = ts.Server(["--config", str(tmp_path / "missing.yaml")], tmp_path / "serve.log", startup_timeout_s=120)
    with pytest.raises(ts.ServeError) as err, server:
        pass
    assert "already in use" not in str(err.value) and len(server.ports) == 1
