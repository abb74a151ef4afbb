"""The server tests' ready wait (tests/proc_output.py) fails at its deadline on a silent child that does not
exit, and at once on one that exits, with what the child printed (CI on 380a0aa hung 600 s in a readline)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from proc_output import ProcOutput


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_silent_child_fails_at_the_deadline_with_its_output():
    proc = _child("import time; print('starting', flush=True); time.sleep(60)")
    try:
        out = ProcOutput(proc)
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=r"no ready line in 1 s \(process still running\):\nstarting"):
            out.wait_line(lambda line: line.startswith("curl "), timeout=1.0)
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait()


def test_exited_child_fails_at_once_and_a_found_line_is_returned():
    out = ProcOutput(_child("print('a'); print('  curl -s x  '); print('b')"))
    assert out.wait_line(lambda line: line.startswith("curl "), timeout=30) == "curl -s x"
    assert out.finish(timeout=30) == 0 and out.text() == "a\n  curl -s x  \nb\n"
    out = ProcOutput(_child("import sys; print('boom'); sys.exit(3)"))
    with pytest.raises(AssertionError, match=r"process ended \(rc 3\):\nboom"):
        out.wait_line(lambda line: line.startswith("curl "), timeout=30)
