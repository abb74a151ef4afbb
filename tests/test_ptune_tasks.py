"""The p-tuning tasks built from the corpus: hash-based splits that are disjoint and stable."""

from __future__ import annotations

import json
from pathlib import Path

from training.ptune_tasks import PLAYS, SPLITS, build_tasks, split_of, write_tasks

SPEECH = "{name}.\nWhat light through yonder window breaks, my lord, tonight?\nIt is the east{i}.\n"


def _corpus(root: Path, n: int = 30) -> list[Path]:
    files = []
    for k, stem in enumerate(PLAYS):
        names = ["King", "Queen", "Ghost"]
        body = "ACT I. SCENE 1.\n\n" + "\n".join(SPEECH.format(name=names[(i + k) % 3], i=f"{stem} {i}")
                                                 for i in range(n))
        p = root / f"{stem}_gut.txt"
        p.write_text(body)
        files.append(p)
    return files


def test_splits_are_disjoint_stable_and_independent_of_the_rest(tmp_path):
    files = _corpus(tmp_path)
    a = build_tasks(files)
    assert a == build_tasks(files)  # stable
    for task, splits in a.items():
        keys = {s: {json.dumps(r, sort_keys=True) for r in splits[s]} for s in SPLITS}
        assert all(keys[s] for s in SPLITS), task  # every split has examples at this size
        assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"] and not keys["val"] & keys["test"]
    # one play's text changed: every other example keeps its split
    first = files[0]
    first.write_text(first.read_text().replace("window", "casement"))
    b = build_tasks(files)
    for s in SPLITS:
        kept = [r for r in a["play"][s] if r["output"] != PLAYS[first.name.removesuffix("_gut.txt")]]
        assert all(r in b["play"][s] for r in kept)
    assert split_of("x") == split_of("x") and {split_of(str(i)) for i in range(200)} == set(SPLITS)


def test_written_files_mark_validation_and_name_both_candidates(tmp_path):
    counts = write_tasks(_corpus(tmp_path), tmp_path / "tasks")
    rows = [json.loads(x) for x in (tmp_path / "tasks" / "next_speaker" / "train.jsonl").read_text().splitlines()]
    assert sum(r.get("split") == "val" for r in rows) == counts["next_speaker"]["val"]
    for r in rows:
        assert r["output"] in r["input"].rsplit("\n", 1)[1]  # the answer is one of the two named
    test = (tmp_path / "tasks" / "play" / "test.jsonl").read_text().splitlines()
    assert len(test) == counts["play"]["test"] and {json.loads(t)["output"] for t in test} <= set(PLAYS.values())
