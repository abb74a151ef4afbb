"""Where engines/cpu/fast_linear.py keeps the kernels it timed for each Linear shape across processes: one JSON
file per user, keyed by machine (fast_linear.machine_key) and shape, written atomically."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("engines.cpu.fast_linear")


def choices_file() -> Path | None:
    """Where choices persist across processes: $SHARDSERVE_FAST_LINEAR_CACHE ("" turns it off), else
    ~/.cache/shardserve/fast_linear.json ($XDG_CACHE_HOME honoured)."""
    env = os.environ.get("SHARDSERVE_FAST_LINEAR_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardserve" / "fast_linear.json"


def shape_key(out_f: int, in_f: int, dtype: torch.dtype, bias: bool) -> str:
    return f"{out_f}x{in_f} {str(dtype).removeprefix('torch.')}{' bias' if bias else ''}"


def load_saved() -> dict:
    path = choices_file()
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # a torn or foreign file: time again, overwrite it
        log.warning("fast_linear: ignoring unreadable %s (%s)", path, exc)
        return {}


def save(machine: str, shape: str, choice: tuple[str, str, str, str], times: list[dict[str, float]]) -> None:
    path = choices_file()
    if path is None:
        return
    data = load_saved()
    data.setdefault(machine, {})[shape] = {
        "kernels": list(choice), "ms": [{k: round(v * 1e3, 4) for k, v in t.items()} for t in times]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file
    except OSError as exc:
        log.warning("fast_linear: could not save choices to %s (%s)", path, exc)
