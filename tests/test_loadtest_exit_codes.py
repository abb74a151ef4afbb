"""`shardserve loadtest`'s exit status is its verdict for CI: a run whose --slo fails, a run in
which no request completed and a sweep that finds no passing rate exit 1, after the results are
printed and written, with the reason on the last line. The written results are the run's own:
a sweep into a reused --result-dir leaves no stale step folders of an earlier one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

from loadtest_support.launcher import FakeServer

from loadtest.cli import loadtest

DEAD = "http://127.0.0.1:9"  # nothing listens there: every request fails at once

app = typer.Typer()
app.command("loadtest")(loadtest)


@app.command("version")
def _version() -> None:  # a second command, so `loadtest` is a subcommand as in shardserve
    typer.echo("0")


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def invoke(url: str, *args: str):
    return CliRunner().invoke(app, ["loadtest", "--url", url, "--model", "m", "--no-progress", *args])


def last_line(res) -> str:
    return res.output.strip().splitlines()[-1]


def test_no_request_completed_exits_1_after_writing(tmp_path):
    out = tmp_path / "run"
    res = invoke(DEAD, "--num-prompts", "5", "--no-preflight", "--result-dir", str(out))
    assert res.exit_code == 1, res.output
    assert last_line(res) == "FAIL: no request completed (5 sent; connection_error: 5)", res.output
    assert json.loads((out / "summary.json").read_text())["summary"]["failed"] == 5


def test_a_failed_slo_exits_1_and_a_met_one_exits_0(server, tmp_path):
    server.configure(ttft=0.03)
    out = tmp_path / "run"
    res = invoke(server.url, "--num-prompts", "4", "--random-output-len", "2", "--slo", "ttft_ms=1",
                 "--result-dir", str(out), "--no-plots")  # fmt: skip
    assert res.exit_code == 1, res.output
    assert last_line(res).startswith("FAIL: SLO not met: ttft_p99_ms "), res.output
    assert last_line(res).endswith(" > 1"), res.output
    assert json.loads((out / "summary.json").read_text())["summary"]["meets_slo"] is False
    res = invoke(server.url, "--num-prompts", "4", "--random-output-len", "2", "--slo", "ttft_ms=5000")
    assert res.exit_code == 0 and "FAIL" not in res.output, res.output


def test_failed_requests_fail_the_slo_they_count_against(server):
    server.configure(error_every=2)  # half the requests fail: infinitely slow for the p99
    res = invoke(server.url, "--num-prompts", "4", "--random-output-len", "2", "--no-preflight",
                 "--slo", "e2el_ms=60000")  # fmt: skip
    assert res.exit_code == 1 and "FAIL: SLO not met: e2el_p99_ms inf > 60000" in last_line(res), res.output


def test_a_sweep_with_no_passing_rate_exits_1_after_writing(tmp_path):
    out = tmp_path / "sweep"
    res = invoke(DEAD, "--sweep", "--num-prompts", "1", "--no-preflight", "--slo", "ttft_ms=100",
                 "--sweep-start-rate", "0.1", "--result-dir", str(out), "--no-plots")  # fmt: skip
    assert res.exit_code == 1, res.output
    assert last_line(res).startswith("FAIL: no rate met the SLO (the lowest tried: "), res.output
    assert json.loads((out / "sweep.json").read_text())["best_rate"] is None


def test_help_documents_the_exit_status():
    res = CliRunner().invoke(app, ["loadtest", "--help"])
    assert res.exit_code == 0 and "Exit status" in res.output and "130" in res.output, res.output


def test_a_shorter_sweep_removes_only_its_own_stale_step_folders(tmp_path):
    out = tmp_path / "sweep"
    sweep = ("--sweep", "--num-prompts", "1", "--no-preflight", "--slo", "ttft_ms=100", "--result-dir", str(out),
             "--no-plots")  # fmt: skip
    invoke(DEAD, *sweep, "--sweep-start-rate", "0.1")  # 0.1 .. 0.0125: four failing steps
    first = sorted(p.name for p in out.glob("step_*"))
    assert len(first) == 4, first
    mine = out / "step_07_rate_9"  # a user's folder of the same form, with a file of their own
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    invoke(DEAD, *sweep, "--sweep-start-rate", "0.02")  # 0.02, 0.01: two steps
    steps = json.loads((out / "sweep.json").read_text())["steps"]
    left = sorted(p.name for p in out.glob("step_*"))
    assert left == sorted([f"step_{i:02d}_rate_{s['rate']:.4g}" for i, s in enumerate(steps)] + [mine.name])
    assert (mine / "notes.txt").read_text() == "keep me"


def _interrupt(server, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a child process, wait until the server has seen 3 requests, send one SIGINT."""
    cmd = [sys.executable, "-c", "import typer; from loadtest.cli import loadtest; typer.run(loadtest)",
           "--url", server.url, "--model", "m", "--no-progress", "--no-preflight", "--random-output-len", "2",
           "--no-plots", *args]  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while server.stats()["arrivals"] < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_writes_what_was_measured_and_exits_130(server, tmp_path):
    server.configure(slow_every=2, slow_ttft=60.0)  # request 2 of 3 hangs until the interrupt
    out = tmp_path / "run"
    res = _interrupt(server, "--num-prompts", "3", "--result-dir", str(out))
    assert res.returncode == 130, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines()[-1].startswith("INTERRUPTED: Ctrl-C stopped the run"), res.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["interrupted"] is True and "Ctrl-C" in doc["stop_reason"]
    assert (doc["summary"]["completed"], doc["summary"]["errors"]) == (2, {"cancelled": 1})
    assert len((out / "requests.jsonl").read_text().splitlines()) == 3


def test_ctrl_c_ends_a_sweep_with_the_steps_run(server, tmp_path):
    server.configure(slow_every=3, slow_ttft=60.0)  # the first step's third request hangs
    out = tmp_path / "sweep"
    res = _interrupt(server, "--sweep", "--num-prompts", "3", "--slo", "e2el_ms=100000", "--result-dir", str(out))
    assert res.returncode == 130, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines()[-1].startswith("INTERRUPTED: Ctrl-C stopped the sweep"), res.stderr
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["interrupted"] is True and len(doc["steps"]) == 1 and doc["best_rate"] is None
