"""Text inputs for `shardserve data`: which files, their documents, and Gutenberg stripping.

An input is a file, a folder (searched recursively) or a glob; the files are `.txt` (one
document per file) or `.jsonl` (one document per line, in the field `text`). Bytes that are not
UTF-8 are replaced with U+FFFD and counted, so a stray Latin-1 file is reported, never a crash.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".txt", ".jsonl")


class CorpusError(ValueError):
    """The inputs cannot be read as a corpus; the message names the file (and line)."""


@dataclass(frozen=True)
class Document:
    name: str
    """`path` for a .txt file, `path:line` for a line of a .jsonl file."""
    text: str


@dataclass
class CorpusReport:
    files: int = 0
    documents: int = 0
    characters: int = 0
    replaced: dict[str, int] = field(default_factory=dict)
    """File -> invalid UTF-8 sequences replaced with U+FFFD (only files that had some)."""

    @property
    def replaced_total(self) -> int:
        return sum(self.replaced.values())


def find_inputs(inputs: list[str]) -> list[Path]:
    """Expand files, folders and globs into a sorted, de-duplicated list of .txt / .jsonl files."""
    if not inputs:
        raise CorpusError("no inputs given: pass files, folders or globs of .txt / .jsonl")
    found: set[Path] = set()
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_file():
            if path.suffix not in SUFFIXES:
                raise CorpusError(f"input {spec!r}: unsupported file type {path.suffix or '(none)'!r}; "
                                  f"expected {' or '.join(SUFFIXES)}")
            found.add(path)
        elif path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
            if not files:
                raise CorpusError(f"input {spec!r}: folder has no {' or '.join(SUFFIXES)} files")
            found.update(files)
        elif glob.has_magic(spec):
            matches = [Path(p) for p in glob.glob(str(path), recursive=True)]
            files = [p for p in matches if p.is_file() and p.suffix in SUFFIXES]
            if not files:
                raise CorpusError(f"input {spec!r}: no {' or '.join(SUFFIXES)} files match this pattern")
            found.update(files)
        else:
            raise CorpusError(f"input {spec!r}: no such file or folder")
    return sorted(found, key=str)


def _decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text and the number of invalid byte sequences replaced by U+FFFD."""
    try:
        return raw.decode("utf-8").removeprefix("\ufeff"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # genuine U+FFFD characters in the input are not errors
        return text.removeprefix("\ufeff"), text.count("\ufffd") - raw.count("\ufffd".encode())


def read_documents(paths: list[Path], strip_gutenberg_text: bool = True) -> tuple[list[Document], CorpusReport]:
    """Documents of the files in order; empty documents are dropped. Raises CorpusError."""
    report = CorpusReport(files=len(paths))
    docs: list[Document] = []
    for path in paths:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        text, bad = _decode(raw)
        if bad:
            report.replaced[str(path)] = bad
        if path.suffix == ".txt":
            if strip_gutenberg_text:
                text = strip_gutenberg(text)
            pieces = [(str(path), text)]
        else:
            pieces = list(_jsonl_texts(path, text))
        for name, piece in pieces:
            piece = piece.replace("\r\n", "\n")
            if piece.strip():
                docs.append(Document(name, piece))
                report.characters += len(piece)
    report.documents = len(docs)
    if not docs:
        raise CorpusError(f"corpus is empty: {len(paths)} file(s) hold no text "
                          f"({', '.join(str(p) for p in paths[:3])}{', ...' if len(paths) > 3 else ''})")
    return docs, report


def _jsonl_texts(path: Path, text: str):
    # JSON Lines end at "\n" only: splitlines() would also cut at U+2028, U+0085 or a form feed,
    # which JSON written with ensure_ascii=False may hold unescaped inside a string
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or "text" not in obj:
            raise CorpusError(f"{path}:{lineno}: expected an object with a string field 'text'")
        if not isinstance(obj["text"], str):
            raise CorpusError(f"{path}:{lineno}: field 'text' must be a string, got {type(obj['text']).__name__}")
        yield f"{path}:{lineno}", obj["text"]


# Project Gutenberg boilerplate. Modern files bracket the work with "*** START OF ..." and
# "*** END OF ..."; 1990s etexts end their header with "*END*THE SMALL PRINT!..." and their
# body with "End of [the] Project Gutenberg Etext ...". The Complete Works interleave a
# "<<THIS ELECTRONIC VERSION ... >>" notice between the plays.
_START = re.compile(r"^[ \t]*\*{3}[ \t]*START OF (?:THIS|THE) PROJECT GUTENBERG[^\n]*\n?", re.IGNORECASE | re.MULTILINE)
_SMALL_PRINT_END = re.compile(r"^[^\n]*\*END\*?[ \t]*THE SMALL PRINT[^\n]*\n?", re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^[ \t]*(?:\*{3}[ \t]*END OF (?:THIS|THE) PROJECT GUTENBERG"
                  r"|END OF (?:THE |THIS )?PROJECT GUTENBERG)", re.IGNORECASE | re.MULTILINE)
_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>[ \t]*\n?", re.DOTALL)
_THE_END = re.compile(r"\n[ \t]*THE END\.?[ \t]*$")
_BLANK_RUNS = re.compile(r"\n{4,}")


def strip_gutenberg(text: str) -> str:
    """The work without Gutenberg header, licence, footer or trailing "THE END"; a no-op on plain text."""
    text = text.replace("\r\n", "\n")
    start = _START.search(text) or _SMALL_PRINT_END.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    text = _NOTICE.sub("", text)
    text = _THE_END.sub("", text.rstrip())
    return _BLANK_RUNS.sub("\n\n\n", text).strip("\n") + "\n"
