"""`shardserve generate`: stream a completion to stdout with the in-process engine."""

from __future__ import annotations

import sys
from pathlib import Path

import typer


def generate(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory (config.json, *.safetensors, tokenizer.json)."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    max_tokens: int = typer.Option(64, help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, help="0 is greedy."),
    top_p: float = typer.Option(0.95, help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 disables."),
    seed: int | None = typer.Option(None, help="Seed for a reproducible sample."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16 (auto: bf16 on bf16 hardware)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Compute the prompt in full "
                                           "(EngineConfig.enable_prefix_caching false)."),
) -> None:
    """Generate a completion of PROMPT and stream the text to stdout as it is produced."""
    from engines import EngineConfig, RequestError, SamplingParams
    from engines.core.llm_engine import LLMEngine

    try:  # argv bytes that are not UTF-8 arrive as lone surrogates (PEP 383), which no tokenizer takes
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        typer.echo("error: --prompt: not valid UTF-8", err=True)
        raise typer.Exit(2) from None
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop))
        engine = LLMEngine(model, EngineConfig(dtype=dtype, enable_prefix_caching=not no_prefix_caching))
        engine.add_request("cli", prompt, params)
    except (RequestError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    sys.stdout.write(prompt)
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
            finish = out.outputs[0].finish_reason
    sys.stdout.write("\n")
    typer.echo(f"[finish_reason={finish}, dtype={engine.config.dtype}]", err=True)  # auto resolved
