"""The one console script, `shardserve`, with a subcommand per job.

Each subcommand is a plain typed function that lives next to the code it drives
(`engines` is excluded: it must run with torch alone, so its command lives here).
Help text comes from the functions' docstrings; defaults are defined once, in the
function signatures or the config dataclasses they build.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="shardserve",
    help="Train, shard, serve, tune and load-test GPT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """shardserve: train, shard, serve, tune and load-test GPT models."""


def _register() -> None:
    # Each module keeps heavy imports (torch, ray) inside its functions, so `--help` stays fast.
    from shardserve import generate_cmd

    app.command("generate")(generate_cmd.generate)
    for module, names in (
        ("training.cli", ("data", "train", "export")),
        ("serving.cli", ("serve",)),
        ("loadtest.cli", ("loadtest",)),
        ("tuner.cli", ("tune",)),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ModuleNotFoundError as exc:  # a package not built yet
            if exc.name and exc.name.startswith(module.split(".")[0]):
                continue
            raise
        for name in names:
            if hasattr(mod, name):
                app.command(name)(getattr(mod, name))
    from deploy.cli import app as deploy_app  # `shardserve deploy render ...`

    app.add_typer(deploy_app, name="deploy")


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
