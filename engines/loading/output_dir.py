"""Where a checkpoint may be written: the guard every writer of model directories goes through.

Writing a checkpoint replaces its folder as a whole (a temporary folder renamed into place, so a
crash never leaves half a model). Replacing is only safe when the folder holds nothing but a
checkpoint's own files: a user's notes, a model's p-tuned tasks or the source model itself must
never go with it. So a non-empty folder is refused unless it holds only checkpoint files AND the
caller asked to overwrite; a folder that is (or contains) the model being read is always refused.
"""

from __future__ import annotations

import re
from pathlib import Path


class OutputDirError(ValueError):
    """The output folder cannot be written without losing something; the message names the option."""


CHECKPOINT_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "training_summary.json",  # the trainer's record beside an exported model (training/summary.py)
})
"""Files this project writes into a model directory (engines/loading/checkpoint.save_checkpoint,
training/export.py); a folder holding anything else is not ours to replace."""
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_HEAD_DIR, _HEAD_FILES = "fp8_head", {"lm_head.safetensors"}  # `shardserve quantize`'s GPTQ LM head


def _ours(entry: Path) -> bool:
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return entry.name == _HEAD_DIR and {e.name for e in entry.iterdir()} <= _HEAD_FILES
    return entry.name in CHECKPOINT_FILES or bool(_SHARD.fullmatch(entry.name))


def is_checkpoint_dir(path: str | Path) -> bool:
    """True when `path` is a folder holding a checkpoint (config.json and weights) and nothing else."""
    p = Path(path)
    if not p.is_dir() or p.is_symlink():
        return False
    entries = list(p.iterdir())
    names = {e.name for e in entries}
    weights = "model.safetensors" in names or "model.safetensors.index.json" in names
    return "config.json" in names and weights and all(_ours(e) for e in entries)


def check_output_dir(out: str | Path, *, what: str = "out_dir", overwrite: bool = False,
                     sources: tuple[str | Path | None, ...] = (), overwrite_hint: str = "pass overwrite=True") -> None:
    """Raise OutputDirError (its message starts with `what`, the option the path came from) unless
    writing a checkpoint to `out` can lose nothing: `out` does not exist, is an empty folder, or is a
    checkpoint folder of this project's files alone and `overwrite` is true. `sources` (the folders
    being read: a model, a run) may be neither `out` nor inside it."""
    p = Path(out)
    resolved = p.resolve()
    for src in sources:
        if src is None:
            continue
        s = Path(src).resolve()
        if s == resolved:
            raise OutputDirError(f"{what}: {str(p)!r} is the source {str(src)!r} itself; write to another folder")
        if resolved in s.parents:
            raise OutputDirError(f"{what}: {str(p)!r} contains the source {str(src)!r}; replacing it would delete "
                                 "the source; write to a new folder")
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"{what}: {str(p)!r} is a file, not a folder; choose a new folder")
    if not p.is_dir() or not any(p.iterdir()):
        return
    if not is_checkpoint_dir(p):
        shown = sorted(e.name for e in p.iterdir())
        listing = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
        raise OutputDirError(f"{what}: {str(p)!r} is not empty and is not a checkpoint folder (it holds {listing}); "
                             "choose a new or empty folder (nothing there was changed)")
    if not overwrite:
        raise OutputDirError(f"{what}: {str(p)!r} already holds a checkpoint; {overwrite_hint} to replace it")
