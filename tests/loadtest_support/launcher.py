"""Start the fake LLM server in a child process and talk to its control endpoint (stdlib only)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

SERVER = Path(__file__).with_name("fake_llm_server.py")


class FakeServer:
    """`with FakeServer() as s:` starts the server on 127.0.0.1:<ephemeral>; `s.url` is its base URL."""

    def __init__(self, uvloop: bool = False, startup_timeout: float = 30.0, **behaviour) -> None:
        cmd = [sys.executable, str(SERVER), "--behaviour", json.dumps(behaviour)]
        if uvloop:
            cmd.append("--uvloop")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + startup_timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("PORT ") or self.proc.poll() is not None:
                break
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"fake server did not start (last output {line!r})")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def configure(self, **behaviour) -> dict:
        """Replace the behaviour (unset fields revert to defaults) and reset the counters."""
        return self._call("/__control", behaviour)

    def stats(self) -> dict:
        return self._call("/__stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the server exits when its stdin closes
                self.proc.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
