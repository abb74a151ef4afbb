"""Where a model path points: a checkpoint directory as is, or a .gguf file imported once into a cache.

`resolve_model(path)` is the one place every entry point (engines.LLM, LLMEngine, `shardserve
serve/generate`, deployment configs' model paths) turns what the user named into a checkpoint
directory. A GGUF file is imported (engines/loading/gguf_import.py) into

    <cache>/gguf/<key>/<file stem>/        key: sha256 of (name, size, mtime ns, dtype)[:16]

so the second start reuses it; the directory's name (the file's stem) is what `serve` names the
model by default. Imports are atomic (temp dir + rename), so concurrent resolvers of the same file
(several replicas starting at once) are safe: the loser of the rename uses the winner's directory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def default_cache_dir() -> Path:
    """~/.cache/shardserve (XDG_CACHE_HOME respected, as every cache on Linux does)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardserve"


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file that starts with the GGUF magic (or is named *.gguf)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def cache_key(path: Path, dtype: str) -> str:
    """A key that changes when the file is replaced or rewritten (name, size, mtime), without hashing 100s of MB."""
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def resolve_model(path: str | Path, cache_dir: str | Path | None = None, dtype: str = "fp32") -> Path:
    """A checkpoint directory for `path`: itself if it is not a GGUF file, else its cached import.

    dtype: weights written by the import ("fp32" keeps the dequantized values exactly; the engine
    casts to its own dtype at load).
    """
    p = Path(path)
    if not is_gguf(p):
        return p
    from engines.loading.gguf_import import GGUFImportError, import_gguf

    out = Path(cache_dir or default_cache_dir()) / "gguf" / cache_key(p, dtype) / p.stem
    if (out / "config.json").is_file():
        return out
    try:
        return import_gguf(p, out, dtype=dtype)
    except (GGUFImportError, OSError):
        if (out / "config.json").is_file():  # another process imported the same file meanwhile
            return out
        raise
