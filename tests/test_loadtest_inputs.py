"""loadtest's input boundary: length specs, option combinations and workload files that used to
crash with a traceback or were silently ignored now give one error naming the option (or the file
and row). No server is needed: every case fails before the first request."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

from loadtest import ConfigError, LoadTestConfig, LoadTestError
from loadtest.cli import loadtest
from loadtest.config import MAX_LENGTH, LengthDist, LengthPair, parse_length_dist, parse_length_mix
from loadtest.prompts import PromptBuilder
from loadtest.workload import from_dataset, from_trace, sample_pairs

URL = "http://127.0.0.1:9"  # nothing listens there; every case below fails before sending

app = typer.Typer()
app.command("loadtest")(loadtest)


@app.command("version")
def _version() -> None:  # a second command, so `loadtest` is a subcommand as in shardserve
    typer.echo("0")


def invoke(*args: str):
    return CliRunner().invoke(app, ["loadtest", "--url", URL, "--model", "m", "--no-progress", *args])


def cfg(**kw) -> LoadTestConfig:
    return LoadTestConfig(**{"url": URL, "model": "m", **kw})


# --- length specs: non-finite or unbounded numbers -------------------------------------------


@pytest.mark.parametrize(
    "flag, spec",
    [
        ("--input-dist", "fixed:inf"),
        ("--input-dist", "fixed:nan"),
        ("--input-dist", "fixed:1e30"),
        ("--output-dist", "normal:100:inf"),
        ("--output-dist", "normal:100:nan"),
        ("--input-dist", "uniform:1:1e30"),
        ("--input-dist", "uniform:1:-inf"),
        ("--input-dist", "normal:100:10:1:1e400"),
        ("--length-mix", "10:10:inf"),
        ("--length-mix", "10:10:1e400"),
        ("--length-mix", "10:10:nan"),
        ("--length-mix", "10:10:0"),
        ("--length-mix", f"10:{MAX_LENGTH + 1}:1"),
    ],
)
def test_unbounded_length_specs_are_usage_errors(flag, spec):
    res = invoke("--num-prompts", "1", flag, spec)
    assert res.exit_code == 2 and f"error: {flag[2:].replace('-', '_')} ({flag})" in res.output, res.output


def test_length_bounds_are_named_in_the_message():
    with pytest.raises(ConfigError, match=rf"--input-dist.*finite and at most {MAX_LENGTH}"):
        parse_length_dist("fixed:inf", 7, "input_dist")
    with pytest.raises(ConfigError, match=r"--length-mix.*finite weight > 0"):
        parse_length_mix("10:10:inf")
    with pytest.raises(ConfigError, match=rf"--random-input-len.*1 to {MAX_LENGTH}"):
        cfg(random_input_len=MAX_LENGTH + 1)
    with pytest.raises(ConfigError, match="--output-dist.*at most"):  # built in Python, not parsed
        cfg(output_dist=LengthDist("uniform", value=5, low=1, high=10**30))
    with pytest.raises(ConfigError, match="--input-dist.*std must be a finite"):
        cfg(input_dist=LengthDist("normal", value=5, std=math.inf, low=1, high=10))
    with pytest.raises(ConfigError, match="--length-mix"):
        cfg(length_mix=(LengthPair(5, 5, math.nan),))


def test_bounded_specs_still_parse():
    assert parse_length_dist(f"fixed:{MAX_LENGTH}", 7, "input_dist").value == MAX_LENGTH
    big = parse_length_dist("normal:100:1e7", 7, "input_dist")  # mean + 4 std is capped, not refused
    assert big.high == MAX_LENGTH
    assert parse_length_mix("10:20,30:40:1e300") == (LengthPair(10, 20, 1.0), LengthPair(30, 40, 1e300))


def test_huge_finite_weights_sample_without_nan():
    mix = (LengthPair(1, 2, 1.5e308), LengthPair(3, 4, 1.5e308))  # their sum overflows to inf
    ins, outs = sample_pairs(mix, 200, np.random.default_rng(0))
    assert set(ins.tolist()) == {1, 3} and set(outs.tolist()) == {2, 4}


# --- options the workload source would silently ignore -----------------------------------------


@pytest.fixture
def files(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0.0, "input_length": 4, "output_length": 2}) + "\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return {"trace": str(trace), "dataset": str(data)}


@pytest.mark.parametrize(
    "source, args, flag",
    [
        ("trace", ["--request-rate", "5"], "--request-rate"),
        ("trace", ["--arrival", "constant"], "--arrival"),
        ("trace", ["--burstiness", "0.5"], "--burstiness"),
        ("trace", ["--input-dist", "fixed:8"], "--input-dist"),
        ("trace", ["--output-dist", "fixed:8"], "--output-dist"),
        ("trace", ["--length-mix", "8:8"], "--length-mix"),
        ("dataset", ["--input-dist", "uniform:2:8"], "--input-dist"),
        (None, ["--time-scale", "0.5"], "--time-scale"),
    ],
)
def test_ignored_options_are_refused_naming_both(files, source, args, flag):
    source_args = [f"--{source}", files[source]] if source else []
    res = invoke("--num-prompts", "1", *source_args, *args)
    assert res.exit_code == 2 and flag in res.output, res.output
    assert f"--{source or 'trace'}" in res.output.split("error:")[-1], res.output


def test_defaults_and_honoured_options_are_not_refused(files):
    cfg(trace=Path(files["trace"]), time_scale=0.5, random_input_len=16)  # random lengths: a shared base
    cfg(dataset=Path(files["dataset"]), output_dist=LengthDist("fixed", 3), random_input_len=16)
    # the defaults go through the CLI: the run gets as far as the (unreachable) server
    for source in ("trace", "dataset"):
        res = invoke("--num-prompts", "1", f"--{source}", files[source])
        assert res.exit_code == 1 and "cannot connect" in res.output, res.output


# --- workload files: rows that would schedule nonsense or send nothing ---------------------------


@pytest.mark.parametrize(
    "row, words",
    [
        ('{"timestamp": NaN, "input_length": 4, "output_length": 2}', "finite numeric timestamp"),
        ('{"timestamp_ms": Infinity, "input_length": 4, "output_length": 2}', "finite numeric timestamp"),
        ('{"timestamp": true, "input_length": 4, "output_length": 2}', "finite numeric timestamp"),
        ('{"timestamp": 1.0, "prompt": "", "output_length": 2}', "prompt is empty"),
    ],
)
def test_bad_trace_rows_name_the_file_and_row(tmp_path, row, words):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0.5, "input_length": 4, "output_length": 2}\n' + row + "\n")
    with pytest.raises(LoadTestError, match=rf"trace.jsonl:2: .*{words}"):
        from_trace(cfg(trace=trace), PromptBuilder(None), None)


@pytest.mark.parametrize(
    "row",
    ['{"prompt": ""}', '{"messages": [{"role": "user", "content": ""}]}', '{"text": ""}'],
)
def test_empty_dataset_prompts_name_the_row(tmp_path, row):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "fine"}\n' + row + "\n")
    with pytest.raises(LoadTestError, match=r"prompts.jsonl:2: the prompt is empty"):
        from_dataset(cfg(dataset=data), 2, PromptBuilder(None))
    res = invoke("--num-prompts", "2", "--dataset", str(data))  # at the CLI: one line, exit 1
    assert res.exit_code == 1 and "prompts.jsonl:2: the prompt is empty" in res.output, res.output
