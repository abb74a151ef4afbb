"""Two p-tuning tasks built from the Shakespeare corpus, with a fixed, hash-based split.

    play          "which play is this line from": one verse line (>= 30 characters) of a speech from
                  one of PLAYS; the answer is the play's title.
    next_speaker  "who speaks next": a speech, and two candidate speakers named in the prompt (the
                  one who speaks next in the scene and another speaker of the same play, in an order
                  fixed by the hash); the answer is the next speaker's name.

Split: each example's key (task, play, text) is hashed (SHA-256); bucket = first 8 bytes mod 100:
< 80 train, 80..89 validation, >= 90 test. An example's split depends on its own text alone, so the
splits are disjoint (duplicates are dropped before splitting) and stable under any change elsewhere in
the corpus. The test split is meant to be scored once, at the end (benchmarks/bench_ptune_real.py).

Written files: <task>/train.jsonl (train, plus the validation records marked "split": "val", which
training/ptune.py uses for early stopping instead of a random hold-out) and <task>/test.jsonl.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

PLAYS = {"hamlet": "Hamlet", "macbeth": "Macbeth", "romeo_and_juliet": "Romeo and Juliet",
         "julius_caesar": "Julius Caesar", "twelfth_night": "Twelfth Night"}
"""corpus file stem (without _gut) -> the answer of the play task."""
TASKS = ("play", "next_speaker")
SPLITS = ("train", "val", "test")
_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,24}\.$")  # "King." / "First Witch." alone on its line


@dataclass(frozen=True)
class Speech:
    play: str
    scene: int
    speaker: str
    lines: tuple[str, ...]


def split_of(key: str) -> str:
    """train / val / test of an example key (80 / 10 / 10 by its SHA-256)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100
    return "train" if bucket < 80 else "val" if bucket < 90 else "test"


def read_speeches(path: Path, play: str) -> list[Speech]:
    """A Gutenberg play's speeches in order: paragraphs whose first line is a speaker's name."""
    out, scene = [], 0
    for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace")):
        lines = [ln.strip() for ln in para.strip().splitlines() if ln.strip()]
        if not lines:
            continue
        if lines[0].upper().startswith(("SCENE", "ACT ")):
            scene += 1
            continue
        if len(lines) >= 2 and _SPEAKER.match(lines[0]):
            text = tuple(ln for ln in lines[1:] if not ln.startswith("["))
            if text:
                out.append(Speech(play, scene, lines[0].rstrip("."), text))
    return out


def build_tasks(corpus_files: list[Path]) -> dict[str, dict[str, list[dict]]]:
    """{task: {split: records {"input", "output"}}} from the corpus files of PLAYS."""
    by_stem = {p.name.removesuffix("_gut.txt"): p for p in corpus_files}
    missing = [s for s in PLAYS if s not in by_stem]
    if missing:
        raise FileNotFoundError(f"corpus: no {', '.join(m + '_gut.txt' for m in missing)}")
    out: dict[str, dict[str, list[dict]]] = {t: {s: [] for s in SPLITS} for t in TASKS}
    seen: set[str] = set()
    for stem, title in PLAYS.items():
        speeches = read_speeches(by_stem[stem], stem)
        speakers = sorted({s.speaker for s in speeches})
        for sp in speeches:
            for line in sp.lines:
                key = f"play\0{line}"
                if len(line) >= 30 and key not in seen:
                    seen.add(key)
                    out["play"][split_of(key)].append({"input": line, "output": title})
        for a, b in itertools.pairwise(speeches):
            if a.scene != b.scene or a.speaker == b.speaker or len(speakers) < 3:
                continue
            text = " ".join(a.lines[:3])
            key = f"next\0{stem}\0{text}"
            if key in seen:
                continue
            seen.add(key)
            h = int.from_bytes(hashlib.sha256(key.encode()).digest()[8:16], "big")
            others = [s for s in speakers if s not in (a.speaker, b.speaker)]
            distractor = others[h % len(others)]
            pair = (b.speaker, distractor) if h % 2 else (distractor, b.speaker)
            prompt = f"{a.speaker}: {text}\nWho speaks next, {pair[0]} or {pair[1]}?"
            out["next_speaker"][split_of(key)].append({"input": prompt, "output": b.speaker})
    return out


def write_tasks(corpus_files: list[Path], out_dir: str | Path) -> dict[str, dict[str, int]]:
    """Write <out_dir>/<task>/train.jsonl (train + "split": "val" records) and test.jsonl; returns counts."""
    counts = {}
    for task, splits in build_tasks(corpus_files).items():
        d = Path(out_dir) / task
        d.mkdir(parents=True, exist_ok=True)
        rows = splits["train"] + [{**r, "split": "val"} for r in splits["val"]]
        (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in splits["test"]))
        counts[task] = {s: len(v) for s, v in splits.items()}
    return counts


if __name__ == "__main__":  # python -m training.ptune_tasks OUT_DIR  (the default corpus, downloaded once)
    import sys

    from training.shakespeare import shakespeare_files

    print(json.dumps(write_tasks(shakespeare_files(), sys.argv[1] if len(sys.argv) > 1 else "data/ptune-tasks")))
