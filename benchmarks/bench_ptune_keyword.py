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

Prints per-class accuracy, balanced accuracy and plain accuracy with 95% Wilson intervals, the
frozen model without a prompt beside it, and the train seconds of each fold's task (<= 300 s).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_ptune import LOVE, TEMPLATE, WAR, first_tokens, write_jsonl
from benchmarks.ptune_keyword_probe import wilson
from engines import LLM
from engines.tokenizer import Tokenizer
from training.ptune import train_task
from training.ptune_recipe import parse_overrides, ptune_recipe_from_dict

LABELS = (" love", " war")


def labelled(data_dir: Path, tok: Tokenizer) -> tuple[list[str], list[tuple[int, int]]]:
    """(all stripped validation lines, [(line index, class)] for the labelled 25-90 character ones)."""
    ids = np.fromfile(data_dir / "val.bin", dtype=np.uint16).tolist()
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
    ap.add_argument("--aug", choices=("none", "windows"), default="windows")
    ap.add_argument("--balance", choices=("under", "over"), default="under",
                    help="under: sample love lines down to the war count; over: repeat war lines up to the love count")
    ap.add_argument("--template", default=TEMPLATE)
    ap.add_argument("--labels", default=",".join(LABELS), help="the love and war label tokens, comma-separated")
    ap.add_argument("--set", dest="set_", action="append", default=[], help="recipe override (repeatable)")
    args = ap.parse_args()
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
    per_fold = []
    for f in range(args.folds):
        if args.only_fold >= 0 and f != args.only_fold:
            continue
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
    for name, pred in (("p-tuned", pred_tuned), ("frozen, no prompt", dict(enumerate(frozen)))):
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
    print("p-tuned output counts:", {o: sum(pred_tuned[n] == o for n in scored) for o in set(pred_tuned.values())})


if __name__ == "__main__":
    main()
