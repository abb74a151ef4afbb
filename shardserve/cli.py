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
    import importlib

    from shardserve import generate_cmd

    app.command("generate")(generate_cmd.generate)
    from shardserve import quantize_cmd  # `shardserve quantize`, `shardserve eval ppl` (FP8, issue 13)

    app.command("quantize")(quantize_cmd.quantize)
    app.add_typer(quantize_cmd.eval_app, name="eval")
    from shardserve import model_cmd  # `shardserve import FILE.gguf`, `shardserve fetch-default` (issue 35)

    app.command("import")(model_cmd.import_)
    app.command("fetch-default")(model_cmd.fetch_default)
    for module, names in (
        ("training.cli", ("data", "train", "export", "check-model")),
        ("training.ptune_cli", ("ptune",)),
        ("serving.cli", ("serve",)),
        ("loadtest.cli", ("loadtest",)),
        ("tuner.cli", ("tune",)),
    ):
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name.replace("-", "_"))
            if isinstance(obj, typer.Typer):  # a command group (e.g. `tune predict`)
                app.add_typer(obj, name=name)
            else:
                app.command(name)(obj)
    from tuner import cli as tuner_cli
    from tuner import train_search

    tuner_cli.tune.command("train")(train_search.tune_train)  # `shardserve tune train`: a training layout
    from deploy.cli import app as deploy_app  # `shardserve deploy render ...`

    app.add_typer(deploy_app, name="deploy")


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
