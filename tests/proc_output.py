"""Read a server subprocess's output without blocking the test on it.

A blocking `proc.stdout.readline()` in a ready-wait loop never reaches the loop's own deadline when the
child prints nothing and does not exit (CI on 380a0aa: `shardserve serve` hung, the test sat in
`readline` until pytest's 600 s timeout killed it, and no output was shown). Here a thread owns the
pipe; the test waits on lines with a deadline and, on failure, sees everything the child printed.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable


class ProcOutput:
    """`out = ProcOutput(proc)` reads `proc.stdout` (text mode) on a daemon thread, line by line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def text(self, start: int = 0) -> str:
        with self._cond:
            return "".join(self.lines[start:])

    def wait_line(self, match: Callable[[str], bool], timeout: float, what: str = "ready line") -> str:
        """The first line (stripped) for which `match` holds; fails at `timeout` seconds, or at once when
        the child's output ends first, with all it printed."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if match(line.strip()):
                        return line.strip()
                seen = len(self.lines)
                if self._eof:
                    try:  # its output ended: it exits (or closed stdout)
                        rc = self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        rc = None
                    raise AssertionError(f"no {what}: the process ended (rc {rc}):\n{self.text()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} in {timeout:.0f} s (process still running):\n{self.text()}")
                self._cond.wait(timeout=min(left, 1.0))

    def finish(self, timeout: float) -> int:
        """Wait for the child to exit and its output to end; its return code (raises on timeout)."""
        rc = self.proc.wait(timeout=timeout)
        self._thread.join(timeout=timeout)
        return rc
