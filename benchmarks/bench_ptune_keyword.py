"""Keyword classification (issue 14) with more training examples and a cross-validated test set.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_ptune_keyword.py --model models/default \
        [--aug windows] [--folds 3] [--set lr=0.1 ...]

The classes are bench_ptune.py's: validation-split lines (25-90 characters) that name love/heart and
not war/sword/blood, and the reverse; the label is one token (" love" / " war"). The split has only
36 war lines, so one held-out split would test ~24 lines; here the labelled lines are dealt into
`--folds` stratified folds and one task is trained per fold on the other folds' lines, so every
labelled line is scored exactly once by a task that never saw it (351 test lines in all; a held-out
line never appears in that fold's training file, neither alone nor inside a window).

--aug windows builds several examples per training line from the validation text around it: the
line alone, with its previous and/or next line as context (context lines that name a keyword of
either class are skipped), and word spans of the line cut around its keyword. Love lines outnumber
war lines ~9:1, so the training set takes as many love examples as war examples (a random sample
of love lines and windows).

--train-split train trains one task on the training split's labelled lines instead (3,165 love and
1,573 war there; --train-lines per class, a validation line's duplicate dropped) and scores it on all
351 validation lines: the task never sees a test line, the base model never saw the split, and the
war class has ~40x the examples the validation split can give a fold. The base model read the
training split's text while pretraining, never a label.

Prints per-class accuracy, balanced accuracy and plain accuracy with 95% Wilson intervals, the
frozen model without a prompt and behind a hand-written prompt of the same N tokens beside it, the
train seconds of each task (<= 300 s), and the first misread lines of each class.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_ptune import LOVE, TEMPLATE, WAR, first_tokens, hand_prompt, write_jsonl
from engines import LLM
from engines.loading.tokenizer import Tokenizer
from training.ptune import train_task
from training.ptune_recipe import parse_overrides, ptune_recipe_from_dict

LABELS = (" love", " war")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def labelled(data_dir: Path, tok: Tokenizer, split: str = "val") -> tuple[list[str], list[tuple[int, int]]]:
    """(all stripped lines of a split, [(line index, class)] for the labelled 25-90 character ones)."""
    ids = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16).tolist()
    lines = [ln.strip() for ln in tok.decode(ids).splitlines()]
    items = []
    for i, ln in enumerate(lines):
        if not 25 <= len(ln) <= 90:
            continue
        lv, wr = bool(LOVE.search(ln)), bool(WAR.search(ln))
        if lv != wr:
            items.append((i, int(wr)))
    return lines, items


def windows(lines: list[str], i: int, cls: int) -> list[str]:
    """Training inputs built around labelled line i: the line, with context lines, and keyword spans."""
    ln = lines[i]
    out = [ln]

    def clean(j: int) -> str | None:
        if 0 <= j < len(lines) and lines[j] and not LOVE.search(lines[j]) and not WAR.search(lines[j]):
            return lines[j]
        return None

    prev, nxt = clean(i - 1), clean(i + 1)
    if prev:
        out.append(prev + "\n" + ln)
    if nxt:
        out.append(ln + "\n" + nxt)
    if prev and nxt:
        out.append(prev + "\n" + ln + "\n" + nxt)
    words = ln.split()
    pat = WAR if cls else LOVE
    hits = [k for k, w in enumerate(words) if pat.search(w)]
    for k in hits[:1]:
        for lo, hi in ((2, 2), (4, 1), (1, 4), (0, 3), (3, 0)):
            span = " ".join(words[max(0, k - lo):k + hi + 1])
            if span != ln and span not in out:
                out.append(span)
    return out


def folds_of(items: list[tuple[int, int]], k: int) -> list[int]:
    """Stratified fold number of every item (each class dealt round-robin after a seeded shuffle)."""
    fold = [0] * len(items)
    for c in (0, 1):
        idx = [n for n, (_, cls) in enumerate(items) if cls == c]
        random.Random(c).shuffle(idx)
        for j, n in enumerate(idx):
            fold[n] = j % k
    return fold


def training_rows(lines, items, fold, f, aug: str, seed: int, labels=LABELS, balance: str = "under") -> list[dict]:
    """Fold f's training rows, classes balanced: "under" samples the majority down to the minority's
    count; "over" keeps every majority example and repeats the minority's (shuffled, cycled) up to it,
    which weights the classes equally like a class-weighted loss while using all the love lines."""
    rng = random.Random(seed + f)
    per_class: list[list[str]] = [[], []]
    for n, (i, cls) in enumerate(items):
        if fold[n] != f:
            per_class[cls] += windows(lines, i, cls) if aug == "windows" else [lines[i]]
    if balance == "under":
        k = min(len(per_class[0]), len(per_class[1]))
        picked = [rng.sample(per_class[c], k) for c in (0, 1)]
    else:
        k = max(len(per_class[0]), len(per_class[1]))
        picked = []
        for c in (0, 1):
            xs = rng.sample(per_class[c], len(per_class[c]))
            picked.append([xs[j % len(xs)] for j in range(k)])
    rows = [{"input": x, "output": labels[c]} for c in (0, 1) for x in picked[c]]
    rng.shuffle(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument("--only-fold", type=int, default=-1, help="train and score this fold only (exploration)")
    ap.add_argument("--train-split", choices=("val", "train"), default="val",
                    help="val: k-fold cross-validation on the validation split's lines; train: one task trained "
                         "on the training split's labelled lines (--train-lines per class at most), scored on "
                         "every validation line (the task never sees one; the base never saw the split)")
    ap.add_argument("--train-lines", type=int, default=1000, help="--train-split train: lines per class at most")
    ap.add_argument("--aug", choices=("none", "windows"), default="windows")
    ap.add_argument("--balance", choices=("under", "over", "natural"), default="under",
                    help="under: sample love lines down to the war count; over: repeat war lines up to the love "
                         "count; natural (--train-split train only): each class's lines as the split has them")
    ap.add_argument("--template", default=TEMPLATE)
    ap.add_argument("--labels", default=",".join(LABELS), help="the love and war label tokens, comma-separated")
    ap.add_argument("--set", dest="set_", action="append", default=[], help="recipe override (repeatable)")
    args = ap.parse_args()
    if args.balance == "natural" if args.train_split == "val" else args.balance == "over":
        ap.error(f"--balance {args.balance} does not apply to --train-split {args.train_split} "
                 "(val: under or over; train: under or natural)")
    model = Path(args.model)
    tok = Tokenizer.from_dir(model)
    labels = tuple(args.labels.split(","))
    assert len(labels) == 2 and all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in labels), \
        f"--labels {labels}: two labels of one token each"
    lines, items = labelled(Path(args.data), tok)
    fold = folds_of(items, args.folds)
    over = {"template": args.template, "append_eos": False, "time_budget_s": 270.0, **parse_overrides(args.set_)}
    recipe = ptune_recipe_from_dict(over)
    work = Path(tempfile.mkdtemp(prefix="bench-ptune-kw-"))
    llm = LLM(model)
    prompt = [args.template.replace("{input}", lines[i]) for i, _ in items]
    pred_tuned: dict[int, str] = {}
    frozen = first_tokens(llm, prompt, 1)
    hand = first_tokens(llm, [hand_prompt(tok, recipe.num_virtual_tokens) + p for p in prompt], 1)  # same N tokens
    per_fold = []
    if args.train_split == "train":  # one task from the training split, every validation line its test
        fold = [0] * len(items)
        tlines, titems = labelled(Path(args.data), tok, "train")
        rng = random.Random(recipe.seed)
        val_lines = {lines[i] for i, _ in items}
        per_class = [[tlines[i] for i, c in titems if c == cls and tlines[i] not in val_lines] for cls in (0, 1)]
        if args.balance == "under":  # as many of each class
            ks = [min(args.train_lines, *map(len, per_class))] * 2
        else:  # "natural": each class's lines up to --train-lines (the split's own ~2:1 love:war)
            ks = [min(args.train_lines, len(xs)) for xs in per_class]
        rows = [{"input": x, "output": labels[c]} for c in (0, 1) for x in rng.sample(per_class[c], ks[c])]
        rng.shuffle(rows)
        print(f"training split: {len(per_class[0])} love / {len(per_class[1])} war labelled lines, {ks[0]} love / {ks[1]} war "
              f"used (none is a validation line)", flush=True)
    for f in range(args.folds if args.train_split == "val" else 1):
        if args.only_fold >= 0 and f != args.only_fold:
            continue
        if args.train_split == "val":
            rows = training_rows(lines, items, fold, f, args.aug, recipe.seed, labels, args.balance)
        held = {lines[i] for n, (i, _) in enumerate(items) if fold[n] == f}
        # a held-out line can sit inside another line or window (repeated phrases): such rows are dropped
        kept = [r for r in rows if not any(h in r["input"] for h in held)]
        if len(kept) < len(rows):
            print(f"fold {f}: dropped {len(rows) - len(kept)} training rows that contain a held-out line", flush=True)
        rows = kept
        t0 = time.perf_counter()
        m = train_task(model, f"kw{f}", write_jsonl(work / f"kw{f}.jsonl", rows), recipe, out_dir=work / f"kw{f}")
        secs = time.perf_counter() - t0
        llm.load_task(f"kw{f}", work / f"kw{f}")
        test = [n for n in range(len(items)) if fold[n] == f]
        for n, out in zip(test, first_tokens(llm, [prompt[n] for n in test], 1, f"kw{f}")):
            pred_tuned[n] = out
        per_fold.append({"fold": f, "train_rows": len(rows), "test": len(test), "train_s": round(secs, 1),
                         "steps": m["steps"], "stopped": m["stopped"], "best_val_loss": round(m["best_val_loss"], 3)})
        print(json.dumps(per_fold[-1]), flush=True)
    scored = sorted(pred_tuned)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True,
                         text=True).stdout.strip()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nCPU: {cpu}; {load}\nmodel {model}; labels {labels}; aug {args.aug}; balance {args.balance}; template {args.template!r}; recipe {over}")
    print("| predictor | love acc. | war acc. | balanced acc. | plain acc. (95% interval) | test lines |")
    print("|---|---|---|---|---|---|")
    for name, pred in (("p-tuned", pred_tuned), ("frozen, no prompt", dict(enumerate(frozen))),
                       ("frozen, hand-written prompt of N tokens", dict(enumerate(hand)))):
        ks = [[0, 0], [0, 0]]
        for n in scored:
            cls = items[n][1]
            ks[cls][1] += 1
            ks[cls][0] += pred[n] == labels[cls]
        (kl, nl), (kw, nw) = ks
        lo, hi = wilson(kl + kw, nl + nw)
        lwl, lwh = wilson(kw, nw)
        print(f"| {name} | {kl / max(nl, 1):.1%} ({kl}/{nl}) | {kw / max(nw, 1):.1%} ({kw}/{nw}; {lwl:.0%}-{lwh:.0%}) "
              f"| {(kl / max(nl, 1) + kw / max(nw, 1)) / 2:.1%} | {(kl + kw) / (nl + nw):.1%} ({lo:.0%}-{hi:.0%}) "
              f"| {nl + nw} |")
    print("max train s per fold:", max(p["train_s"] for p in per_fold), "(target <= 300)")
    for cls in (0, 1):
        wrong = [lines[items[n][0]] for n in scored if items[n][1] == cls and pred_tuned[n] != labels[cls]]
        print(f"misread {labels[cls]!r} lines ({len(wrong)}, first 8):", *(repr(w) for w in wrong[:8]), sep="\n  ")
    print("p-tuned output counts:", {o: sum(pred_tuned[n] == o for n in scored) for o in set(pred_tuned.values())})


if __name__ == "__main__":
    main()
