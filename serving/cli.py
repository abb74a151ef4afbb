"""`shardserve serve`: run the gateway and model servers on Ray Serve until Ctrl-C."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import typer


def serve(
    config: Path | None = typer.Option(  # typer's idiom
        None, "--config", "-c", help="Deployment config (YAML), e.g. deploy/examples/default.yaml."),
    model: Path | None = typer.Option(
        None, "--model", "-m", help="Serve this checkpoint directory or .gguf file (instead of --config)."),
    name: str | None = typer.Option(None, "--name", help="Model name for --model (default: the directory's name)."),
    host: str | None = typer.Option(None, "--host", help="Interface to bind (default: the config's, 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="HTTP port (default: the config's, 8000)."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster to join (host:6379 or ray://host:10001); "
                                "default: start a local Ray."),
    verbose: bool = typer.Option(False, "--verbose", help="Show Ray and Ray Serve logs."),
    no_prefix_caching: bool = typer.Option(
        False, "--no-prefix-caching", help="Compute every prompt in full (every model's "
        "engine.enable_prefix_caching: false)."),
) -> None:
    """Serve models over HTTP (OpenAI /v1 and KServe v2 /v2 APIs, /metrics) on Ray Serve.

    Starts an embedded local Ray unless --address names a cluster; binds 127.0.0.1 unless told
    otherwise. API keys come from the config's server.api_keys_file or $SHARDSERVE_API_KEYS.
    Ctrl-C drains in-flight requests (server.drain_timeout_s) and stops.
    """
    from deploy.schema import ConfigFileError, read_api_keys

    try:
        cfg = deployment_config(config, model, name, host, port, address, no_prefix_caching)
        keys = read_api_keys(cfg.server)
        admin_keys = read_api_keys(cfg.server, admin=True)
    except (ConfigFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    from serving import launcher

    try:
        launcher.check_config(cfg)
    except ConfigFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    names = ", ".join(f"{m.name} ({m.path})" for m in cfg.models)
    where = f"joining Ray at {cfg.ray.address}" if cfg.ray.address else "starting a local Ray"
    typer.echo(f"shardserve: serving {names}; {where} ...")
    _take_signals()
    running = None
    try:
        running = launcher.start(cfg, keys, quiet=not verbose, admin_keys=admin_keys)
        _take_signals()  # again: ray.init installed its own SIGTERM handler (which exits at once)
        _print_ready(running.url, cfg.models[0].name, bool(keys), running.started_in_s, running.phases)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo(f"\nshardserve: draining (up to {cfg.server.drain_timeout_s:g} s) and stopping ...")
    except Exception as exc:  # noqa: BLE001 - a failed start: say why, in one line, and stop Ray
        typer.echo(f"error: the server did not start: {exc}", err=True)
        _stop(running)
        raise typer.Exit(1) from None
    _stop(running)
    typer.echo("shardserve: stopped")


def deployment_config(config: Path | None, model: Path | None, name: str | None = None, host: str | None = None,
                      port: int | None = None, address: str | None = None, no_prefix_caching: bool = False):
    """The DeploymentConfig `serve` runs: the file's (or one --model's) with the flags applied;
    raises ConfigFileError or ValueError naming the problem."""
    from deploy.schema import ConfigFileError, DeploymentConfig, load_config
    from engines.loading.model_source import resolve_model  # a .gguf model path: imported once into a cache

    if config is not None and model is not None:
        raise ConfigFileError("give --config FILE or --model DIR, not both")
    if config is not None:
        cfg = load_config(config)
    elif model is not None:
        cfg = DeploymentConfig.for_model_dir(str(resolve_model(model)), name=name)
    else:
        raise ConfigFileError("nothing to serve: give --model DIR or --config FILE")
    server = cfg.server.model_dump()
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    ray = cfg.ray.model_dump()
    if address is not None:
        ray["address"] = address
    models = cfg.model_dump()["models"]
    for m in models:
        m["path"] = str(resolve_model(m["path"]))
    if model is not None and address is None:
        # one model on the embedded Ray of this host: its replica reserves every core, so Ray's
        # OMP_NUM_THREADS (the replica's reserved CPUs, 1 by default) gives its engine all of them
        from engines.cpu.cpu_threads import host_cores

        models[0]["num_cpus"] = float(host_cores())
    if no_prefix_caching:
        for m in models:
            m["engine"]["enable_prefix_caching"] = False
    return cfg.replace(server=server, ray=ray, models=models)


def _take_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM (docker stop, systemd) both drain and stop. SIGINT is set
    explicitly too: a process started in the background by a non-interactive shell inherits it
    ignored, and `kill -INT` would then do nothing."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop(running) -> None:
    from serving import launcher

    try:
        launcher.stop(running)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once
        import ray

        ray.shutdown()


def _print_ready(url: str, model: str, auth: bool, seconds: float, phases: dict[str, float] | None = None) -> None:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32})
    key = ' -H "Authorization: Bearer $SHARDSERVE_API_KEY"' if auth else ""
    split = f" ({', '.join(f'{k} {v:.1f} s' for k, v in phases.items())})" if phases else ""
    typer.echo(f"shardserve: ready in {seconds:.1f} s{split} at {url}  (OpenAI: {url}/v1, KServe v2: {url}/v2, "
               f"metrics: {url}/metrics; Ctrl-C stops)")
    typer.echo("try:")
    typer.echo(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json'{key} -d '{body}'")
    sys.stdout.flush()
