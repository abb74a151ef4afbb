"""`shardserve loadtest` through loadtest.cli.loadtest, registered on a local typer app (as
shardserve.cli registers it), against the fake streaming server."""

from __future__ import annotations

import csv
import json
import socket
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

from loadtest_support.launcher import FakeServer
from loadtest_support.timing import check_timing

from loadtest.cli import loadtest

app = typer.Typer()
app.command("loadtest")(loadtest)


@app.command("version")
def _version() -> None:  # a second command, so `loadtest` is a subcommand as in shardserve
    typer.echo("0")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def invoke(*args: str):
    return CliRunner().invoke(app, ["loadtest", *args])


def test_run_writes_results(server, tmp_path):
    server.configure(ttft=0.02, itl=0.005)
    out = tmp_path / "results"
    res = invoke(
        "--url", server.url, "--model", "fake", "--request-rate", "50", "--num-prompts", "30", "--warmup", "5",
        "--random-input-len", "12", "--random-output-len", "6", "--slo", "ttft_p99_ms=500", "--goodput", "tpot:100",
        "--result-dir", str(out), "--api-key", "secret", "--no-progress",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (
        "Load test result" in res.output and "Goodput (req/s)" in res.output and "approximate" in res.output
    )
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 35 and sum(r["warmup"] for r in rows) == 5
    assert all(r["error_kind"] is None and len(r["itl_ms"]) == 5 for r in rows)
    doc = json.loads((out / "summary.json").read_text())
    assert doc["summary"]["requests"] == 30 and doc["summary"]["good_requests"] == 30
    assert doc["config"]["api_key"] == "***" and doc["config"]["request_rate"] == 50.0
    measured = sorted(r["ttft_ms"] for r in rows if not r["warmup"])
    assert doc["summary"]["ttft_ms"]["p50"] == pytest.approx((measured[14] + measured[15]) / 2)  # 30 values
    with open(out / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["ttft_ms_p99"]) == pytest.approx(doc["summary"]["ttft_ms"]["p99"])
    assert (out / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--request-rate", "-1"], 2, "--request-rate"),
        (["--input-dist", "zipf:1.2"], 2, "unknown distribution 'zipf'"),
        (["--backend", "grpc"], 2, "openai-completions, openai-chat, kserve-generate-stream"),
        (["--slo", "latency=5"], 2, "unknown SLO"),
        (["--duration", "2"], 2, "--duration"),
        (["--sweep"], 2, "a sweep needs at least one SLO"),
    ],
)
def test_bad_arguments_give_clear_errors(server, args, code, message):
    res = invoke("--url", server.url, "--model", "fake", "--no-progress", *args)
    assert res.exit_code == code and message in res.output, res.output


def test_unreachable_and_non_streaming_servers(server):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    res = invoke("--url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "1", "--no-progress")
    assert res.exit_code == 1 and "cannot connect" in res.output
    server.configure(non_streaming=True)
    res = invoke("--url", server.url, "--model", "m", "--num-prompts", "1", "--no-progress")
    assert res.exit_code == 1 and "did not stream" in res.output


def test_sweep_prints_a_table_and_writes_plots(server, tmp_path):
    server.configure(max_concurrent=4, service_time=0.05)  # capacity 80 req/s
    attempt = iter(range(3))

    def measure() -> list[str]:
        out = tmp_path / f"sweep{next(attempt)}"
        res = invoke(
            "--url", server.url, "--model", "fake", "--sweep", "--arrival", "constant", "--duration", "0.6",
            "--random-output-len", "2", "--slo", "e2el_p50_ms=150", "--sweep-start-rate", "20",
            "--sweep-tolerance", "0.3", "--result-dir", str(out), "--no-progress",
        )  # fmt: skip
        with open(out / "sweep.csv") as f:
            steps = list(csv.DictReader(f))
        # exit 1 exactly when no rate passed (the sweep's verdict for CI)
        assert res.exit_code == (0 if "True" in {s["meets_slo"] for s in steps} else 1), res.output
        if {s["meets_slo"] for s in steps} != {"True", "False"}:  # a stall failed even the first rate
            return [f"no step both met and missed the SLO: {[(s['rate'], s['meets_slo']) for s in steps]}"]
        assert "Highest rate meeting the SLO" in res.output and "FAIL" in res.output
        assert len(steps) >= 3
        best = json.loads((out / "sweep.json").read_text())["best_rate"]
        assert best == max(float(s["rate"]) for s in steps if s["meets_slo"] == "True")
        assert (out / "sweep.png").read_bytes()[:8] == PNG_MAGIC
        assert len(list(out.glob("step_*/requests.jsonl"))) == len(steps)
        return []

    check_timing(measure)
