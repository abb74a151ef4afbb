"""`shardserve tune ...`: predictions from hardware profiles, the cost model and the simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

tune = typer.Typer(name="tune", help="Predict and tune serving configurations for an SLO.",
                   no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


MODEL_HELP = "Checkpoint folder (its config.json is read) or an HF config.json of a supported model."


def _model(path: Path):
    """The ModelConfig of --model: a checkpoint folder, as every other command's --model takes, or its
    config.json alone (the tuner needs the shape, not the weights)."""
    from engines.core.config import ConfigError, ModelConfig

    source = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if Path(path).is_dir() and not source.is_file():
        _fail(f"--model: the folder {str(path)!r} has no config.json; give a checkpoint folder or an HF config.json")
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        _fail(f"--model: no such file or folder {str(path)!r}")
    except UnicodeDecodeError as exc:
        _fail(f"--model: {source}: not UTF-8 text ({exc.reason} at byte {exc.start}); give an HF config.json")
    except json.JSONDecodeError as exc:
        _fail(f"--model: {source} is not valid JSON ({exc})")
    except OSError as exc:
        _fail(f"--model: cannot read {source} ({exc.strerror or exc})")
    if not isinstance(data, dict):
        _fail(f"--model: {source} must hold a JSON object (an HF config.json)")
    try:
        return ModelConfig.from_hf(data)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        _fail(f"--model: {source} is not the config.json of a supported model ({exc})")


def _at_least_one(**flags: int) -> None:
    """Each count flag (--block-size=..., keyed block_size) >= 1: a 0 divides by zero or starves
    the simulated scheduler further in."""
    for name, value in flags.items():
        if value < 1:
            _fail(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value}")


def _fits_context(model, input_len: int, output_len: int) -> None:
    """A request of input_len + output_len tokens must fit the model's context: the engine refuses
    a longer one, so a prediction for it would be of a request that cannot run."""
    limit = model.max_position_embeddings
    if input_len + output_len > limit:
        _fail(f"--input-len: {input_len} prompt tokens + --output-len {output_len} exceed the model's context "
              f"of {limit} tokens (max_position_embeddings); at most {max(limit - output_len, 0)} with this "
              "--output-len")


RECALIBRATE_HELP = ("Measured profiles: take the host reference now (~1 s) and scale the profile's CPU-bound "
                    "and memory-bound terms by this host's speed now against its speed while it was profiled "
                    "(tuner.hostref; for shared or cloud hosts whose speed drifts).")


def _recalibrated(profile, recalibrate: bool):
    if not recalibrate:
        return profile
    if not profile.host_reference:
        _fail(f"--recalibrate: profile {profile.name!r} has no host_reference (built-in profiles and profiles "
              "measured before it existed); measure one with `shardserve tune profile`")
    from tuner.hostref import host_reference, recalibrated

    return recalibrated(profile, host_reference(cache_mib=profile.cache_mib or 32.0))


def _cost(model, hardware: str, tp: int, pp: int, weight_dtype: str, recalibrate: bool = False):
    """The cost model of `model` (a ModelConfig read by _model) on --hardware."""
    from tuner.cost import CostModel, LayoutError
    from tuner.profiles import ProfileError, load_profile

    try:
        profile = _recalibrated(load_profile(hardware), recalibrate)
        return CostModel(model, profile, tp=tp, pp=pp, weight_dtype=weight_dtype)
    except (ProfileError, LayoutError) as exc:
        _fail(str(exc))


@tune.command("predict")
def predict(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    hardware: str = typer.Option(..., "--hardware", help="Built-in profile name (a100-80gb, h100-sxm, h200) "
                                 "or the path of a profile YAML."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel stages."),
    batch: int = typer.Option(1, "--batch", help="Requests arriving together."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(128, "--output-len", help="Output tokens per request."),
    weight_dtype: str = typer.Option("bfloat16", "--weight-dtype", help="bfloat16, float16, float32 or fp8."),
    recalibrate: bool = typer.Option(False, "--recalibrate", help=RECALIBRATE_HELP),
) -> None:
    """Predict a static batch (all requests arrive together; latency until the last token, as
    FasterTransformer and NeMo report it) and print one JSON object."""
    from tuner.cost import static_batch

    _at_least_one(batch=batch, input_len=input_len, output_len=output_len)
    m = _model(model)
    _fits_context(m, input_len, output_len)
    cost = _cost(m, hardware, tp, pp, weight_dtype, recalibrate)
    out = static_batch(cost, batch, input_len, output_len)
    out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}
    if cost.profile.host_scale:
        out["host_scale"] = cost.profile.host_scale
    typer.echo(json.dumps({**out, "hardware": cost.profile.name, "tp": tp, "pp": pp, "batch": batch,
                           "input_len": input_len, "output_len": output_len, "weight_dtype": weight_dtype}))


@tune.command("simulate")
def simulate_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    hardware: str = typer.Option(..., "--hardware", help="Built-in profile name or profile YAML path."),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    weight_dtype: str = typer.Option("bfloat16", "--weight-dtype"),
    request_rate: float = typer.Option(1.0, "--request-rate", help="Requests/s (open loop)."),
    arrival: str = typer.Option("poisson", "--arrival", help="poisson, gamma or constant."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape (gamma arrivals)."),
    num_prompts: int = typer.Option(500, "--num-prompts"),
    input_len: int = typer.Option(128, "--input-len"),
    output_len: int = typer.Option(128, "--output-len"),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
    block_size: int = typer.Option(16, "--block-size"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Simulate one engine under an open-loop load with the engine's own scheduler and print
    the predicted TTFT / TPOT / ITL / E2E percentiles, throughput and KV memory as JSON."""
    import numpy as np

    from engines.core.scheduler import SchedulerConfig
    from loadtest.arrivals import schedule
    from tuner.cost import GIB
    from tuner.simulate import simulate, summarize

    if arrival not in ("poisson", "gamma", "constant"):
        _fail(f"--arrival: must be poisson, gamma or constant, got {arrival!r}")
    if not request_rate > 0:
        _fail(f"--request-rate: must be a number of requests/s > 0 (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        _fail(f"--burstiness: must be a finite number > 0 (1 = Poisson), got {burstiness}")
    if arrival != "gamma" and burstiness != 1.0:  # as the load tester refuses it (loadtest/config.py)
        _fail(f"--burstiness: applies to --arrival gamma only; got --arrival {arrival}")
    _at_least_one(num_prompts=num_prompts, input_len=input_len, output_len=output_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
    m = _model(model)
    _fits_context(m, input_len, output_len)
    cost = _cost(m, hardware, tp, pp, weight_dtype)
    kv_budget = cost.kv_budget_bytes()
    if kv_budget <= 0:
        _fail(f"does not fit: weights need {cost.weight_bytes_per_device() / GIB:.1f} GiB per device of "
              f"{cost.profile.memory_gib} GiB ({cost.profile.name}); raise --tp/--pp or use --weight-dtype fp8")
    num_blocks = int(kv_budget // (cost.kv_bytes_per_token() * block_size))
    # more blocks than max_num_seqs full-length requests never change the schedule
    num_blocks = min(num_blocks, max_num_seqs * -(-(input_len + output_len) // block_size))
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size, num_blocks=num_blocks,
                          max_model_len=min(cost.model.max_position_embeddings, input_len + output_len + 1))
    times = schedule(arrival, request_rate, burstiness, count=num_prompts, seed=seed)
    traces = simulate(cost.step_time, cfg, times, np.full(num_prompts, input_len), np.full(num_prompts, output_len))
    out = summarize(traces)
    out["kv_blocks"] = num_blocks
    out["kv_cache_gib_per_device"] = num_blocks * block_size * cost.kv_bytes_per_token() / GIB
    out["memory_gib_per_device"] = cost.weight_bytes_per_device() / GIB + out["kv_cache_gib_per_device"]
    typer.echo(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


@tune.command("search")
def search_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    hardware: str = typer.Option(..., "--hardware", help="Built-in profile name or profile YAML path."),
    devices: int = typer.Option(8, "--devices", help="Device budget; replicas fill it."),
    slo: list[str] = typer.Option([], "--slo", help="As in loadtest: ttft_p99_ms=500, tpot_ms=50 (repeatable)."),
    objective: str = typer.Option("goodput", "--objective", help="goodput (per device), throughput or latency."),
    input_len: int = typer.Option(128, "--input-len"),
    output_len: int = typer.Option(128, "--output-len"),
    num_prompts: int = typer.Option(150, "--num-prompts", help="Simulated requests per rate probe."),
    model_path: str = typer.Option("", "--model-path", help="Checkpoint in the emitted YAML (and served by "
                                   "--validate); empty: models/default in the YAML, and --validate serves a "
                                   "random-weight checkpoint of --model's shape (timing does not depend on weights)."),
    out: Path = typer.Option(Path("runs/tune"), "--out", help="Result directory (table JSON, Pareto PNG, YAML)."),
    top: int = typer.Option(10, "--top", help="Rows of the ranked table to print."),
    weight_dtype: list[str] = typer.Option(["bfloat16", "fp8"], "--weight-dtype",
                                           help="Weight dtypes to search (repeatable): bfloat16, float16, float32, fp8."),
    tp: list[int] = typer.Option([1, 2, 4, 8], "--tp", help="Tensor-parallel sizes to search (repeatable)."),
    pp: list[int] = typer.Option([1, 2, 4], "--pp", help="Pipeline stages to search (repeatable)."),
    max_num_seqs: list[int] = typer.Option([64, 256], "--max-num-seqs", help="Batch limits to search (repeatable)."),
    max_num_batched_tokens: list[int] = typer.Option([2048, 8192], "--max-num-batched-tokens",
                                                     help="Per-step token budgets to search (repeatable)."),
    validate: int = typer.Option(0, "--validate", help="Serve the top K configs with `shardserve serve`, "
                                 "load-test them, print predicted against measured, refit and re-rank."),
    validate_prompts: int = typer.Option(40, "--validate-prompts", help="Requests per validation load test."),
    validate_min_step_s: float | None = typer.Option(None, "--validate-min-step-s", help="Seconds each goodput-sweep "
                                                     "step offers its rate for at least (its requests grow to rate x "
                                                     "this): a sustained load, not a burst. Default: 5 x the largest "
                                                     "TTFT or E2EL SLO bound, as the search simulates goodput."),
    validate_sweep_tolerance: float = typer.Option(0.05, "--validate-sweep-tolerance", help="The goodput sweep "
                                                   "stops bisecting when its last passing and first failing rate "
                                                   "are this close (relative); larger: fewer, coarser steps."),
    recalibrate: bool = typer.Option(False, "--recalibrate", help=RECALIBRATE_HELP),
) -> None:
    """Search TP x PP x max_num_seqs x max_num_batched_tokens x weight dtype for the SLOs; print a
    ranked table, write results.json, pareto.png and the chosen config as deployment YAML.

    On a measured CPU profile the host is one device: its shards share its cores, one replica."""
    import time

    from loadtest.config import ConfigError as LoadConfigError
    from loadtest.config import parse_slo
    from tuner.cost import WEIGHT_DTYPES
    from tuner.profiles import ProfileError, load_profile
    from tuner.search import OBJECTIVES, Workload, evaluate, grid, rank

    bad = [d for d in weight_dtype if d not in WEIGHT_DTYPES]
    if bad or not weight_dtype:
        _fail(f"--weight-dtype: must be among {', '.join(WEIGHT_DTYPES)}, got {', '.join(bad) or 'none'}")
    if objective not in OBJECTIVES:
        _fail(f"--objective: must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if devices < 1 or input_len < 1 or output_len < 1 or num_prompts < 1:
        _fail("--devices, --input-len, --output-len and --num-prompts must be >= 1")
    for flag, vals in (("--tp", tp), ("--pp", pp), ("--max-num-seqs", max_num_seqs),
                       ("--max-num-batched-tokens", max_num_batched_tokens)):
        if not vals or min(vals) < 1:
            _fail(f"{flag}: every value must be >= 1, got {vals}")
    if validate < 0 or validate_prompts < 4:
        _fail(f"--validate must be >= 0 and --validate-prompts >= 4, got {validate} and {validate_prompts}")
    if validate_min_step_s is not None and not (0 <= validate_min_step_s < float("inf")):
        _fail(f"--validate-min-step-s: must be a finite number of seconds >= 0, got {validate_min_step_s}")
    if not 0 < validate_sweep_tolerance < 1:
        _fail(f"--validate-sweep-tolerance: must be in (0, 1), got {validate_sweep_tolerance}")
    try:
        slos = tuple(parse_slo(s) for s in slo)
    except LoadConfigError as exc:
        _fail(str(exc))
    m = _model(model)
    _fits_context(m, input_len, output_len)
    try:
        profile = _recalibrated(load_profile(hardware), recalibrate)
    except ProfileError as exc:
        _fail(str(exc))
    if validate:  # refused before the search, not after minutes of it
        _check_validate(profile, model_path)
    t0 = time.perf_counter()
    cands = evaluate(m, profile, grid(m, devices, tps=tuple(tp), pps=tuple(pp), seqs=tuple(max_num_seqs),
                                      tokens=tuple(max_num_batched_tokens), dtypes=tuple(dict.fromkeys(weight_dtype)),
                                      cores=profile.cores), Workload(input_len, output_len, num_prompts), slos)
    elapsed = time.perf_counter() - t0
    ranked = rank(cands, objective)
    pruned = [c for c in cands if c.pruned]
    if not ranked:
        reasons = sorted({c.pruned for c in pruned}) or ["no rate meets the SLOs"]
        _fail(f"no configuration meets the SLOs on {devices} x {profile.name}: " + "; ".join(reasons[:5]))
    typer.echo(f"{len(cands)} configs ({len(pruned)} pruned) simulated in {elapsed:.1f} s; objective {objective}")
    typer.echo(f"{'tp':>3} {'pp':>3} {'rep':>4} {'seqs':>5} {'tokens':>6} {'dtype':>9} {'goodput/dev':>11} "
               f"{'tok/s/dev':>10} {'latency_ms':>10} {'ttft_p99':>9} {'tpot_p99':>9}")
    for c in ranked[:top]:
        x = c.metrics
        typer.echo(f"{c.tp:>3} {c.pp:>3} {c.replicas:>4} {c.max_num_seqs:>5} {c.max_num_batched_tokens:>6} "
                   f"{c.weight_dtype:>9} {x['goodput_per_device']:>11.2f} {x['throughput_tok_s_per_device']:>10.1f} "
                   f"{x['latency_ms']:>10.1f} {x.get('ttft_p99_ms', 0):>9.1f} {x.get('tpot_p99_ms', 0):>9.1f}")
    out.mkdir(parents=True, exist_ok=True)
    rows = [{**{k: v for k, v in c.__dict__.items() if k != "metrics"}, **c.metrics} for c in cands]
    (out / "results.json").write_text(json.dumps({"elapsed_s": elapsed, "objective": objective,
                                                  "slos": [s.key for s in slos], "configs": rows}, indent=1))
    _pareto(ranked, out / "pareto.png")
    best = ranked[0]
    from tuner.emit import deployment, write_yaml

    write_yaml(deployment(best, model_path or "models/default", profile), out / "tuned.yaml",
               "written by `shardserve tune search`")
    typer.echo(f"chosen: tp={best.tp} pp={best.pp} replicas={best.replicas} -> {out / 'tuned.yaml'}")
    if validate:
        from tuner.validate import ValidateSettings

        settings = ValidateSettings(num_prompts=validate_prompts, recalibrate=recalibrate,
                                    sweep_min_step_s=validate_min_step_s, sweep_tolerance=validate_sweep_tolerance)
        _validate(ranked, validate, m, profile, Workload(input_len, output_len, num_prompts), slos, objective, out,
                  model_path, settings)


def _check_validate(profile, model_path: str) -> None:
    """--validate serves on this host: a profile measured here, and a checkpoint when one is named."""
    if profile.kind != "measured":
        _fail(f"--validate serves on this machine: --hardware must be a profile measured here by "
              f"`shardserve tune profile`, got the {profile.kind} profile {profile.name!r}")
    if model_path and not (Path(model_path) / "config.json").is_file():
        _fail(f"--model-path: {model_path} has no config.json (a shardserve checkpoint directory)")


def _validate(ranked, k, m, profile, w, slos, objective, out, model_path, settings) -> None:
    from tuner.closed_loop import closed_loop
    from tuner.server import ServeError
    from tuner.validate import METRICS

    try:
        rep = closed_loop(ranked, k, m, profile, w, slos, objective, out, model_path or None,
                          settings,
                          progress=lambda s: typer.echo(s, err=True))
    except (ServeError, FileNotFoundError) as exc:
        _fail(str(exc))
    typer.echo("\npredicted / measured (error) on each candidate's accuracy run; goodput by rate sweep")
    for c in rep["candidates"]:
        cfg = c["config"]
        cells = "  ".join(f"{key} {c['predicted'][key]:.1f}/{c['measured'][key]:.1f} ({c['error'][key]:+.0%})"
                          for key in METRICS)
        typer.echo(f"tp={cfg['tp']} pp={cfg['pp']} seqs={cfg['max_num_seqs']} tokens={cfg['max_num_batched_tokens']} "
                   f"{cfg['weight_dtype']}: {cells}; goodput/device predicted {c['predicted_goodput_per_device']:.2f} "
                   f"measured {c['measured_goodput_per_device']:.2f} req/s")
    typer.echo(f"the pick's measured goodput is {rep['pick_within_pct_of_best']:.1f}% below the best validated "
               f"({rep['pick_measured_goodput_per_device']:.2f} vs {rep['best_measured_goodput_per_device']:.2f} req/s/device)")
    typer.echo(f"refit factors: {json.dumps(rep['refit_factors'])}; report: {out / 'validation.json'}, "
               f"{out / 'validation.png'}, refitted profile {out / 'refit.yaml'}")


def _pareto(ranked, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype, marker in (("bfloat16", "o"), ("float16", "o"), ("float32", "s"), ("fp8", "^")):
        sel = [c for c in ranked if c.weight_dtype == dtype]
        if sel:
            ax.scatter([c.metrics["latency_ms"] for c in sel], [c.metrics["throughput_tok_s_per_device"] for c in sel],
                       marker=marker, label=dtype, alpha=0.7)
    pts = sorted((c.metrics["latency_ms"], c.metrics["throughput_tok_s_per_device"]) for c in ranked)
    front, best = [], -1.0
    for lat, thr in pts:
        if thr > best:
            front.append((lat, thr))
            best = thr
    ax.plot(*zip(*front, strict=True), "k--", lw=1, label="Pareto front")
    ax.set_xlabel("latency of one request alone (ms)")
    ax.set_ylabel("output tokens/s per device at goodput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@tune.command("profile")
def profile_cmd(
    out: Path = typer.Option(Path("runs/tune/this-machine.yaml"), "--out", help="Where the profile YAML goes."),
    name: str = typer.Option("this-machine", "--name", help="Profile name."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Also time requests through a real "
                               "`shardserve serve` (gateway + Ray overhead per request and per token)."),
    dtype: str = typer.Option("auto", "--dtype", help="Engine dtype the step constants are fitted in: auto (what "
                              "the engine picks here), bfloat16 or float32."),
    serving_cores: int = typer.Option(0, "--serving-cores", help="Cores a copy of one shard leaves to the serving "
                                      "side (event loop, Ray, gateway, streams): its engine runs a fixed cores - N "
                                      "threads, measured and deployed so (default 0: the engine picks each step's "
                                      "count itself; at most cores - 1)."),
) -> None:
    """Measure this machine (matmul rate per dtype, row count and threads; read bandwidth; the
    engine's per-step, per-layer, per-sequence and attention costs; gloo all-reduce and send;
    gateway + Ray overhead) into a profile YAML that --hardware accepts; the served probes' steps
    that the fit saw go beside it (OUT with the suffix .steps.json)."""
    import time

    from tuner.measure import measure

    if dtype not in ("auto", "bfloat16", "float32"):
        _fail(f"--dtype: must be auto, bfloat16 or float32, got {dtype!r}")
    from engines.cpu.cpu_threads import host_cores

    cores = host_cores()
    if not 0 <= serving_cores < cores:
        _fail(f"--serving-cores: must be an integer >= 0 and below this host's {cores} cores (the engine keeps "
              f"at least one), got {serving_cores}")
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    prof = measure(name, serve=serve, dtype=dtype, serving_cores=serving_cores, steps_out=out.with_suffix(".steps.json") if serve else None,
                   progress=lambda msg: typer.echo(f"[{time.perf_counter() - t0:5.1f} s] {msg}", err=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    typer.echo(json.dumps(prof.to_dict()))
    typer.echo(f"saved {out} in {time.perf_counter() - t0:.1f} s")
