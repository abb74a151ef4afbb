# ruff: noqa: B008  (typer declares options as call defaults, the idiom shardserve.cli uses)
"""`shardserve loadtest`: the command-line face of loadtest.

A plain typed function; shardserve.cli registers it with typer. Flag names follow vLLM's
benchmark_serving where one exists. Defaults come from LoadTestConfig / SweepConfig (one place
defines each); heavy modules load inside the function so `shardserve --help` stays fast.
"""

from pathlib import Path

import typer

from loadtest.config import LoadTestConfig, SweepConfig

_RUN = LoadTestConfig.__dataclass_fields__
_SWEEP = SweepConfig.__dataclass_fields__


def _d(name: str):
    return _RUN[name].default


def _s(name: str):
    return _SWEEP[name].default


def loadtest(
    url: str = typer.Option(..., help="Server base URL (http://host:port) or full endpoint URL."),
    model: str = typer.Option(..., help="Model name sent with each request (KServe: in the URL path)."),
    backend: str = typer.Option(
        _d("backend"), help="openai-completions | openai-chat | kserve-generate-stream."
    ),
    request_rate: float = typer.Option(
        _d("request_rate"), help="Mean requests/s of the open-loop schedule; inf sends all at t=0."
    ),
    burstiness: float = typer.Option(
        _d("burstiness"), help="Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier."
    ),
    arrival: str = typer.Option(
        _d("arrival"), help="constant | poisson | gamma (gamma with --burstiness 1 is Poisson)."
    ),
    max_concurrency: int | None = typer.Option(
        _d("max_concurrency"), help="Cap on requests in flight (later sends wait)."
    ),
    closed_loop_concurrency: int | None = typer.Option(
        _d("closed_loop_concurrency"),
        help="Closed loop: this many workers, each sends when its last reply ends.",
    ),
    num_prompts: int | None = typer.Option(
        _d("num_prompts"), help="Measured requests (default 1000 unless --duration)."
    ),
    duration: float | None = typer.Option(
        _d("duration"), help="Stop scheduling requests after this many seconds."
    ),
    warmup: int = typer.Option(_d("warmup"), help="Requests sent first and excluded from statistics."),
    random_input_len: int = typer.Option(
        _d("random_input_len"), help="Prompt tokens for --input-dist fixed."
    ),
    random_output_len: int = typer.Option(
        _d("random_output_len"), help="max_tokens for --output-dist fixed."
    ),
    input_dist: str | None = typer.Option(
        None, help="fixed | fixed:N | uniform:LOW:HIGH | normal:MEAN:STD[:LOW:HIGH] (prompt tokens)."
    ),
    output_dist: str | None = typer.Option(None, help="Same forms as --input-dist, for max_tokens."),
    length_mix: str | None = typer.Option(
        None, help="Weighted (input, output) pairs: IN:OUT:WEIGHT,IN:OUT:WEIGHT."
    ),
    dataset: Path | None = typer.Option(
        _d("dataset"), help="JSONL prompts: prompt | messages, optional output_len."
    ),
    trace: Path | None = typer.Option(
        _d("trace"), help="JSONL trace: timestamp (s) or timestamp_ms, input_length, output_length."
    ),
    time_scale: float = typer.Option(
        _d("time_scale"), help="Multiply trace inter-arrival times (0.5 = twice as fast)."
    ),
    tokenizer: Path | None = typer.Option(
        _d("tokenizer"), help="tokenizer.json for exact prompt lengths; else approximate."
    ),
    ignore_eos: bool = typer.Option(
        _d("ignore_eos"), help="Send ignore_eos and min_tokens to hold outputs at max_tokens."
    ),
    include_usage: bool = typer.Option(
        _d("include_usage"), help="Ask for stream usage (exact output-token counts)."
    ),
    slo: list[str] | None = typer.Option(
        None, help="SLO, repeatable: METRIC_ms=V or METRIC_STAT_ms=V (ttft|tpot|e2el; mean|p50|p90|p95|p99)."
    ),
    goodput: list[str] | None = typer.Option(
        None, help="vLLM spelling of an SLO, repeatable: ttft:500, tpot:50, e2el:2000."
    ),
    sweep: bool = typer.Option(False, help="Find the highest request rate that meets every SLO."),
    sweep_start_rate: float = typer.Option(_s("start_rate"), help="First rate of the sweep (req/s)."),
    sweep_max_rate: float = typer.Option(_s("max_rate"), help="Highest rate the sweep tries (req/s)."),
    sweep_tolerance: float = typer.Option(_s("tolerance"), help="Stop bisecting when hi/lo - 1 <= this."),
    sweep_min_step_s: float = typer.Option(
        _s("min_step_s"), help="Offer each step's rate for at least this many seconds (a step of --num-prompts "
        "requests grows to rate x this): a few requests at a high rate are a burst, not a sustained load."
    ),
    result_dir: Path | None = typer.Option(
        _d("result_dir"), help="Write requests.jsonl, summary.json/.csv and plots here."
    ),
    plots: bool = typer.Option(True, help="Write PNG plots into --result-dir."),
    seed: int = typer.Option(_d("seed"), help="Seed for prompts, lengths and arrival times."),
    content_seed: int | None = typer.Option(
        _d("content_seed"), help="Seed for the synthetic prompts' words alone: the same lengths and arrivals "
        "(--seed) with other words, so a repetition meets no prefix-cache hits. Default: --seed."),
    api_key: str | None = typer.Option(_d("api_key"), help="Sent as Authorization: Bearer KEY."),
    timeout: float = typer.Option(_d("timeout"), help="Per-request limit in seconds."),
    preflight: bool = typer.Option(
        _d("preflight"), help="Send one short request first to check URL and streaming."
    ),
    progress: bool = typer.Option(_d("progress"), help="Show a live progress bar."),
) -> None:
    """Load-test an OpenAI-compatible or KServe v2 server: latency percentiles, goodput, SLO sweeps.

    Open-loop arrivals by default (a slow server never delays a send); TTFT, TPOT, ITL and
    end-to-end latency as vLLM's benchmark defines them; goodput against --slo; --sweep finds the
    highest request rate that meets every SLO. See docs/loadtest.md.

    Exit status (so CI sees the result; files are written first either way): 0 the run finished and
    met every --slo; 1 an --slo was not met, no request completed, a sweep found no passing rate, or
    the server could not be reached; 2 a usage error; 130 interrupted (Ctrl-C: what was measured is
    still written; a second Ctrl-C stops at once). The last line says why a run failed.
    """
    from loadtest.config import parse_length_dist, parse_length_mix, parse_slo
    from loadtest.errors import ConfigError, LoadTestError

    try:
        slos = tuple(parse_slo(s) for s in [*(slo or []), *(goodput or [])])
        config = LoadTestConfig(
            url=url,
            model=model,
            backend=backend,
            request_rate=request_rate,  # a sweep sets its own rates
            burstiness=burstiness,
            arrival=arrival,
            max_concurrency=max_concurrency,
            closed_loop_concurrency=closed_loop_concurrency,
            num_prompts=num_prompts,
            duration=duration,
            warmup=warmup,
            random_input_len=random_input_len,
            random_output_len=random_output_len,
            input_dist=parse_length_dist(input_dist, random_input_len, "input_dist") if input_dist else None,
            output_dist=parse_length_dist(output_dist, random_output_len, "output_dist")
            if output_dist
            else None,
            length_mix=parse_length_mix(length_mix) if length_mix else (),
            dataset=dataset,
            trace=trace,
            time_scale=time_scale,
            tokenizer=tokenizer,
            ignore_eos=ignore_eos,
            include_usage=include_usage,
            slos=slos,
            seed=seed,
            content_seed=content_seed,
            api_key=api_key,
            timeout=timeout,
            preflight=preflight,
            progress=progress,
            result_dir=result_dir,
        )
        if sweep:
            sc = SweepConfig(start_rate=sweep_start_rate, max_rate=sweep_max_rate, tolerance=sweep_tolerance,
                             min_step_s=sweep_min_step_s)
            failure = _run_sweep(config, sc, plots)
        else:
            failure = _run_once(config, plots)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except LoadTestError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if failure is not None:  # last, after the results are printed and written
        code, reason = failure
        typer.echo(f"{'FAIL' if code == 1 else 'INTERRUPTED'}: {reason}", err=True)
        raise typer.Exit(code)


def run_failure(summary) -> str | None:
    """Why a finished run counts as failed for CI, or None: no request completed (a dead server
    must not pass a job that gave no SLO), or an SLO given with --slo was not met."""
    if summary.completed == 0:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(summary.errors.items()))
        return f"no request completed ({summary.requests} sent{'; ' + errors if errors else ''})"
    if summary.meets_slo is False:
        missed = [f"{r.key} {r.observed_ms:.2f} > {r.threshold_ms:g}" for r in summary.slo_results if not r.ok]
        return "SLO not met: " + (", ".join(missed) or "the run was stopped early")
    return None


def _run_once(config: LoadTestConfig, plots: bool) -> tuple[int, str] | None:
    from loadtest.report import format_summary, write_run
    from loadtest.runner import run

    report = run(config, stop_on_sigint=True)
    typer.echo(format_summary(report.summary))
    if config.result_dir is not None:
        paths = write_run(report, config.result_dir, plots=plots)
        typer.echo(f"Wrote {', '.join(p.name for p in paths)} to {config.result_dir}")
    if report.interrupted:  # 130 as for any Ctrl-C, but with what was measured kept
        return 130, "Ctrl-C stopped the run; the results above cover the requests sent until then"
    failure = run_failure(report.summary)
    return None if failure is None else (1, failure)


def _run_sweep(config: LoadTestConfig, sc: SweepConfig, plots: bool) -> tuple[int, str] | None:
    from loadtest.report import SWEEP_HEADER, format_sweep_row, format_sweep_table, write_sweep
    from loadtest.slo_sweep import sweep as run_sweep

    typer.echo(SWEEP_HEADER)
    result = run_sweep(config, sc, on_step=lambda step: typer.echo(format_sweep_row(step)), stop_on_sigint=True)
    typer.echo("\nSorted by rate:\n" + format_sweep_table(result))
    if config.result_dir is not None:
        write_sweep(result, config.result_dir, plots=plots)
        typer.echo(
            f"Wrote sweep.json, sweep.csv{', sweep.png' if plots else ''} and per-step files to {config.result_dir}"
        )
    if result.interrupted:
        return 130, "Ctrl-C stopped the sweep; the results above cover the steps run until then"
    if result.best_rate is None:
        return 1, f"no rate met the SLO (the lowest tried: {min(s.rate for s in result.steps):.3g} req/s)"
    return None
