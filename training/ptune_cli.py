"""`shardserve ptune`: train a p-tuned task on a frozen model (help text from the docstring)."""

from __future__ import annotations

from pathlib import Path

import typer


def ptune(
    model: Path = typer.Option(..., "--model", "-m", help="Model folder (config.json, weights, tokenizer.json)."),
    task: str = typer.Option(..., "--task", "-t", help="Task name: letters, digits, '_', '-', '.' (max 64)."),
    data: Path = typer.Option(..., "--data", "-d", help="JSONL with string fields 'input' and 'output'."),
    out: Path | None = typer.Option(None, help="Task folder [default: MODEL/ptuning/TASK]."),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Override a recipe key, e.g. --set lr=0.01 --set encoder=lstm (repeatable)."),
    resume: bool = typer.Option(False, help="Start from the task folder's prompt_encoder.safetensors."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the task folder when it holds an earlier "
                                   "task (its files only: a folder holding anything else is refused)."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
) -> None:
    """Train N virtual tokens (a prompt encoder) for TASK on a frozen MODEL; answer-only loss.

    Writes a PEFT-compatible adapter (adapter_config.json, adapter_model.safetensors) plus task.json,
    metrics.jsonl, loss_curve.png and the encoder (for --resume). Serve it with `"task": TASK`.

    The task folder (--out, or MODEL/ptuning/TASK) is checked before training: it must be new or empty, or
    hold an earlier task, which is replaced only with --overwrite (or continued with --resume). The model
    folder, a folder containing it, a file, or a folder holding anything else is refused.
    """
    import json

    from engines.core.config import ConfigError
    from engines.transforms.ptuning import TaskError, check_task_name
    from training.ptune import DatasetError, check_task_out, train_task
    from training.ptune_recipe import parse_overrides, ptune_recipe_from_dict

    try:
        recipe = ptune_recipe_from_dict(parse_overrides(set_))
        if out is None:  # the model's own slot: the REST job retrains it in place; here replacing needs --overwrite
            check_task_name(task)
            check_task_out(model, model / "ptuning" / task, overwrite or resume, "--task")
        metrics = train_task(model, task, data, recipe, out_dir=out, progress=progress, resume=resume,
                             overwrite=overwrite)
    except (ConfigError, DatasetError, TaskError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(metrics, indent=2))
