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


class ExportError(ValueError):
    """The export cannot be written (no tokenizer, unknown dtype, bad checkpoint)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(model: torch.nn.Module, cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | Path,
                 dtype: str = "float32", init_dir: str | Path | None = None) -> Path:
    """Write `model` as an HF-compatible directory with the tokenizer files of `tokenizer_dir`
    (tokenizer_config.json and chat_template.jinja carry the chat template). A fine-tuned model
    (`init_dir`: the directory it started from) keeps that model's generation_config.json (extra
    EOS ids, default sampling values) and any tokenizer file the data folder lacks."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ExportError(f"tokenizer: {str(tokenizer_dir)!r} has no tokenizer.json "
                          "(pass the data folder the model was trained on)")
    out = save_checkpoint(model, cfg.replace(dropout=0.0), out_dir, dtype=DTYPES[dtype], tokenizer_dir=tokenizer_dir)
    from training.data import TOKENIZER_FILES

    for name in TOKENIZER_FILES:  # save_checkpoint copies the first three; a template file too
        for src_dir in (tokenizer_dir, init_dir):
            src = Path(src_dir) / name if src_dir else None
            if src is not None and src.is_file() and not (out / name).is_file():
                shutil.copyfile(src, out / name)
    if init_dir and (Path(init_dir) / "generation_config.json").is_file():
        shutil.copyfile(Path(init_dir) / "generation_config.json", out / "generation_config.json")
    # save_checkpoint's temporary directory (mkdtemp) and safetensors files are private (0700 / 0600);
    # a model directory is meant to be read by servers running as other users
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                      dtype: str = "float32") -> Path:
    """Export the model of a training checkpoint (a run folder or its checkpoint.safetensors)."""
    from safetensors import safe_open

    from training.model_setup import build_model
    from training.recipe import recipe_from_dict
    from training.state import CHECKPOINT, ResumeError, model_tensors, read_meta

    path = Path(checkpoint)
    if path.is_dir() and (path / "checkpoint" / "layout.json").is_file():  # a Megatron run: per-rank shards
        return _export_shards(path / "checkpoint", out_dir, tokenizer_dir, dtype)
    if path.is_dir() and (path / "layout.json").is_file():
        return _export_shards(path, out_dir, tokenizer_dir, dtype)
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
    return export_model(model, recipe.model, out_dir, tokenizer_dir or recipe.data.dir, dtype, recipe.init or None)


def _export_shards(shard_dir: Path, out_dir, tokenizer_dir, dtype: str) -> Path:
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
                        recipe.init or None)
