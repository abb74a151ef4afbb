"""Export: a trained GPT -> the engine's HF-compatible directory (config, safetensors, tokenizer).

The exported config drops dropout (serving never uses it); weights, names and shapes are exactly
the training model's, written by `engines.loading.checkpoint.save_checkpoint`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engines.core.config import ModelConfig
from engines.loading.checkpoint import save_checkpoint
from engines.loading.output_dir import OutputDirError, check_output_dir


class ExportError(ValueError):
    """The export cannot be written (no tokenizer, unknown dtype, bad checkpoint)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(model: torch.nn.Module, cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | Path,
                 dtype: str = "float32", init_dir: str | Path | None = None, overwrite: bool = False,
                 what: str = "out.export_dir") -> Path:
    """Write `model` as an HF-compatible directory with the tokenizer files of `tokenizer_dir`
    (tokenizer_config.json and chat_template.jinja carry the chat template). A fine-tuned model
    (`init_dir`: the directory it started from) keeps that model's generation_config.json (extra
    EOS ids, default sampling values) and any tokenizer file the data folder lacks.

    `out_dir` (named `what` in errors: the option it came from) must be new or empty, or hold a
    checkpoint of this project's files alone and `overwrite` be true; anything else raises
    ExportError and nothing is written or deleted (engines/loading/output_dir.py)."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ExportError(f"tokenizer: {str(tokenizer_dir)!r} has no tokenizer.json "
                          "(pass the data folder the model was trained on)")
    check_export_dir(out_dir, what, overwrite, tokenizer_dir, init_dir)
    gen = Path(init_dir) / "generation_config.json" if init_dir else None
    try:
        out = save_checkpoint(model, cfg.replace(dropout=0.0), out_dir, dtype=DTYPES[dtype],
                              tokenizer_dir=tokenizer_dir, overwrite=overwrite, generation_config=gen)
    except OutputDirError as exc:  # changed since check_export_dir looked
        raise ExportError(f"{what}: {str(exc).partition(': ')[2]}") from None
    from training.data import TOKENIZER_FILES

    for name in TOKENIZER_FILES:  # a tokenizer file the data folder lacks comes from the model fine-tuned
        src = Path(init_dir) / name if init_dir else None
        if src is not None and src.is_file() and not (out / name).is_file():
            shutil.copyfile(src, out / name)
            (out / name).chmod((out / "config.json").stat().st_mode & 0o666)
    return out


def check_export_dir(out_dir: str | Path, what: str = "out.export_dir", overwrite: bool = False,
                     *sources: str | Path | None) -> None:
    """Raise ExportError naming `what` unless a model can be exported to `out_dir` without deleting
    anything but an earlier export (with `overwrite`); `sources` (run, data, init folders) may be
    neither `out_dir` nor inside it. Cheap: call it before the work that ends in the export."""
    hint = "pass --overwrite" if what == "--out" else "remove it or choose another folder"
    try:
        check_output_dir(out_dir, what=what, overwrite=overwrite, sources=sources, overwrite_hint=hint)
    except OutputDirError as exc:
        raise ExportError(str(exc)) from None


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                      dtype: str = "float32", overwrite: bool = False) -> Path:
    """Export the model of a training checkpoint (a run folder or its checkpoint.safetensors) to
    `out_dir` (`shardserve export --out`: checked before anything is read; see export_model)."""
    check_export_dir(out_dir, "--out", overwrite, checkpoint, tokenizer_dir)
    from safetensors import safe_open

    from training.model_setup import build_model
    from training.recipe import recipe_from_dict
    from training.state import CHECKPOINT, ResumeError, model_tensors, read_meta

    path = Path(checkpoint)
    if path.is_dir() and (path / "checkpoint" / "layout.json").is_file():  # a Megatron run: per-rank shards
        return _export_shards(path / "checkpoint", out_dir, tokenizer_dir, dtype, overwrite)
    if path.is_dir() and (path / "layout.json").is_file():
        return _export_shards(path, out_dir, tokenizer_dir, dtype, overwrite)
    if path.is_dir():
        path = path / CHECKPOINT
    try:
        meta = read_meta(path)
    except ResumeError as exc:
        raise ExportError(str(exc)) from exc
    recipe = recipe_from_dict(meta["recipe"])
    model = build_model(recipe.model, seed=0, device=torch.device("cpu")).eval()
    with safe_open(path, framework="pt") as f, torch.no_grad():
        keys = set(f.keys())
        for name, t in model_tensors(model).items():
            if f"model.{name}" not in keys:
                raise ExportError(f"{path}: checkpoint lacks model tensor {name!r}")
            t.copy_(f.get_tensor(f"model.{name}"))
    return export_model(model, recipe.model, out_dir, tokenizer_dir or recipe.data.dir, dtype, recipe.init or None,
                        overwrite, "--out")


def _export_shards(shard_dir: Path, out_dir, tokenizer_dir, dtype: str, overwrite: bool = False) -> Path:
    """One HF-compatible directory from a parallel run's shards (training/parallel/state.py)."""
    from engines.model.transformer import GPT
    from training.parallel.state import assemble_shards
    from training.recipe import recipe_from_dict

    recipe_d, full = assemble_shards(shard_dir)
    recipe = recipe_from_dict(recipe_d)
    model = GPT(recipe.model)
    missing, unexpected = model.load_state_dict(full, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and recipe.model.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"{shard_dir}: shards do not make the model (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    return export_model(model.eval(), recipe.model, out_dir, tokenizer_dir or recipe.data.dir, dtype,
                        recipe.init or None, overwrite, "--out")
