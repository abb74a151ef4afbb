"""Direct ingress: a Gateway replica serves HTTP itself, on the configured host and port.

With Ray Serve's HTTP proxy, every request and every streamed chunk crosses one more process:
client -> proxy actor -> (ASGI messages over Ray) -> Gateway replica. On a small machine that hop
is most of the serving path's CPU (BENCHMARKS.md, serving). With `server.ingress: direct` the
proxy is off and each Gateway replica runs uvicorn on its own event loop, bound with SO_REUSEPORT
so that several Gateway replicas on one node share the port (the kernel spreads connections).
Ray Serve still owns the replicas: it starts, health-checks (a stopped server fails the check)
and replaces them; on shutdown the server stops accepting and lets in-flight requests finish for
up to drain_timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # the replica's process belongs to Ray: never take over its signal handlers
        yield


def bind(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    """A listening TCP socket on host:port; OSError (EADDRINUSE, ...) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (checked before Ray starts)."""
    try:
        bind(host, port, reuse_port=False).close()
    except OSError as exc:
        return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


class DirectHTTP:
    def __init__(self, app, host: str, port: int, drain_timeout_s: float):
        self.host, self.port, self.drain_timeout_s = host, port, drain_timeout_s
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=30, timeout_graceful_shutdown=drain_timeout_s or None)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        sock = bind(self.host, self.port)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError(f"the gateway's HTTP server on {self.host}:{self.port} stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway's HTTP server on {self.host}:{self.port} did not start in "
                                   f"{timeout_s:.0f} s")
            await asyncio.sleep(0.01)

    def check_health(self) -> None:
        if self.task is None or self.task.done():
            raise RuntimeError(f"the gateway's HTTP server on {self.host}:{self.port} is not running")

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to drain_timeout_s), then close."""
        if self.task is None or self.task.done():
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), self.drain_timeout_s + 5)
