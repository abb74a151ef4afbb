"""`shardserve deploy ...`: deployment files rendered from a deployment config."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(name="deploy", help="Deployment files from a deployment config (deploy/schema.py).",
                  no_args_is_help=True, add_completion=False)


@app.command("render")
def render(
    config: Path = typer.Option(..., "--config", "-c", help="Deployment config (YAML), e.g. deploy/compose/config.yaml."),
    target: str = typer.Option(..., "--target", "-t", help="kuberay (RayService), compose (docker-compose.yml) "
                               "or ray-serve (a `serve deploy` config)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="File to write (default: standard output)."),
    image: str = typer.Option("shardserve:latest", help="Container image (kuberay, compose)."),
) -> None:
    """Render a deployment config as a KubeRay RayService, a docker-compose file or a Ray Serve config.

    Each rendering carries the whole config, so the same schema drives `shardserve serve`, Ray
    Serve, Kubernetes and compose. Fields a target cannot honour are named in the error
    (e.g. KubeRay needs server.ingress: ray-proxy and server.host: 0.0.0.0).
    """
    from deploy.render import TARGETS
    from deploy.render import render as render_text
    from deploy.schema import ConfigFileError, load_config

    try:
        if target not in TARGETS:
            raise ConfigFileError(f"--target: must be one of {', '.join(TARGETS)}; got {target!r}")
        options = {} if target == "ray-serve" else {"image": image}
        text = render_text(load_config(config), target, source=str(config), **options)
    except ConfigFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)
