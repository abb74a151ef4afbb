"""`shardserve serve` as a subprocess on 127.0.0.1, for measurements and validation runs.

The tuner never imports serving/: it starts the same command a user would, waits for /health,
and stops the whole process group (gateway, Ray, shard workers) when done.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

POLL_S = 0.2
"""Seconds between two readiness polls of a starting server."""
_STOPPED: set[int] = set()


def stopped_sessions() -> frozenset[int]:
    """The session ids of the servers this process has stopped (each Server's CLI leads its own
    session, and its Ray processes, which go on exiting for seconds after it, stay in it)."""
    return frozenset(_STOPPED)


class ServeError(RuntimeError):
    """The server did not come up; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TRIES = 3
"""Starts on a fresh port when the server finds its port taken: free_port() lets the port go again before the server
binds it, seconds later (after Ray's start, whose processes open connections from ephemeral ports meanwhile: a CI run
of `tune search --validate` lost its port so, the replica's bind failing with EADDRINUSE)."""


class Server:
    """`with Server(["--config", path], log) as url:` serves until the block ends."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 240.0,
                 cwd: str | Path | None = None, env: dict[str, str] | None = None):
        self.base_args = list(args)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.cwd = cwd
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.ports = [free_port()]  # every port tried, the last the one served on

    @property
    def port(self) -> int:
        return self.ports[-1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def args(self) -> list[str]:
        return [*self.base_args, "--host", "127.0.0.1", "--port", str(self.port)]

    def __enter__(self) -> str:
        for _ in range(PORT_TRIES - 1):
            try:
                return self.start(append=len(self.ports) > 1)
            except ServeError as exc:
                if "already in use" not in str(exc):
                    raise
                self.stop()
                self.ports.append(free_port())
        return self.start(append=len(self.ports) > 1)

    def start(self, append: bool = False) -> str:
        """Runs the server on self.port until it answers /health (its url); ServeError with the log's tail when it
        exits or is not ready in time. append: add to the log (a retry) instead of starting it afresh."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab" if append else "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # the checkout this code runs from wins over an installed copy, in the server too
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        # Ray nices its worker processes (the replicas, the gateway, the shard actors) to 15; on a
        # shared host every nice-19 job then takes a third of a core from the engine being measured,
        # so the profile's probes and the accuracy runs depend on whatever else runs. A measurement
        # runs at its caller's priority (Ray's own job manager does the same for its drivers).
        env["RAY_worker_niceness"] = "0"
        env.update(self.env)
        self.proc = subprocess.Popen([sys.executable, "-m", "shardserve.cli", "serve", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        # one client for every poll: httpx.get builds a client, and with it an SSL context that loads the CA
        # bundle, each time (0.07 s of CPU; ~6 s over a 40 s start at two polls a second, taken from the
        # start it waits for on a 2-core host); with that gone a poll is cheap enough to come every 0.2 s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServeError(f"shardserve serve exited with {self.proc.returncode} before it was ready:\n"
                                     + self.log_tail())
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                time.sleep(POLL_S)
        self.stop()
        raise ServeError(f"shardserve serve was not ready within {self.startup_timeout_s:.0f} s:\n" + self.log_tail())

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        _STOPPED.add(self.proc.pid)  # start_new_session: the CLI's pid is its session's id
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)  # the CLI drains and shuts Ray down on SIGINT
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()
