"""P-tuning quality on the default model (models/default), data from the corpus's validation split.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_ptune.py [--model models/default]

1. Keyword classification: lines about love/heart vs war/sword/blood, label one token (" love" /
   " war"); accuracy of the first generated token on held-out lines, for the trained task, the
   frozen model alone, and the frozen model behind a hand-written prompt of the same N tokens.
2. Format: two tasks on the same inputs whose completions must start with their speaker tag;
   compliance of each on held-out lines (and of the frozen model, for reference).
Held-out lines are never in a task's training file. Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from engines import LLM, SamplingParams
from engines.loading.tokenizer import Tokenizer
from training.ptune import train_task
from training.ptune_recipe import PtuneRecipe, parse_overrides, ptune_recipe_from_dict

LOVE = re.compile(r"\b(love|loves|loved|lover|heart|hearts)\b", re.IGNORECASE)
WAR = re.compile(r"\b(war|wars|sword|swords|blood|bloody)\b", re.IGNORECASE)
TEMPLATE = "{input}\nTopic:"
HAND = "Say love if the line speaks of love or the heart; say war if it speaks of war, a sword or blood."
TAGS = ("HAMLET.", "OPHELIA.")


def val_lines(data_dir: Path, tok: Tokenizer, split: str = "val") -> list[str]:
    """The split's lines of 25-90 characters, stripped."""
    ids = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16).tolist()
    text = tok.decode(ids)
    return [ln.strip() for ln in text.splitlines() if 25 <= len(ln.strip()) <= 90]


def split(items: list, n_test: int, seed: int = 0) -> tuple[list, list]:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items[n_test:], items[:n_test]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def first_tokens(llm: LLM, prompts: list[str], n: int, task: str | None = None) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), task=task)
    return [o.outputs[0].text for o in outs]


def hand_prompt(tok: Tokenizer, n: int, text: str = HAND) -> str:
    ids = tok.encode(text, add_special_tokens=False)
    ids = (ids * (n // len(ids) + 1))[:n]  # exactly n tokens, like the n virtual tokens
    return tok.decode(ids) + "\n"


def train(model: Path, name: str, rows: list[dict], recipe: PtuneRecipe, work: Path) -> tuple[dict, float]:
    """Train one task in a fresh folder; (metrics, wall seconds including model load and saving)."""
    t0 = time.perf_counter()
    m = train_task(model, name, write_jsonl(work / f"{name}.jsonl", rows), recipe, out_dir=work / name)
    return m, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--tasks", default="kw,fmt", help="comma list of kw (keyword classification), fmt (format)")
    ap.add_argument("--tags", default=",".join(TAGS), help="comma list of the format tasks' speaker tags")
    ap.add_argument("--show", type=int, default=0, help="print this many p-tuned outputs per task (diagnosis)")
    ap.add_argument("--set", dest="set_", action="append", default=[],
                    help="recipe override for every task, e.g. --set lr=0.01 (repeatable)")
    ap.add_argument("--kw-set", action="append", default=[], help="recipe override for the keyword task only")
    ap.add_argument("--fmt-set", action="append", default=[],
                    help="recipe override for the format tasks only; {tag} in init_text is the task's tag")
    args = ap.parse_args()
    model = Path(args.model)
    tok = Tokenizer.from_dir(model)
    lines = val_lines(Path(args.data), tok)
    # the recipe's defaults (what a user gets) within the 300 s limit, then the overrides
    common = {"time_budget_s": 270.0, **parse_overrides(args.set_)}
    work = Path(tempfile.mkdtemp(prefix="bench-ptune-"))
    llm = LLM(model)
    results = []
    if "kw" in args.tasks.split(","):
        love = [ln for ln in lines if LOVE.search(ln) and not WAR.search(ln)]
        war = [ln for ln in lines if WAR.search(ln) and not LOVE.search(ln)]
        k = min(len(love), len(war))
        rows = ([{"input": ln, "output": " love"} for ln in love[:k]]
                + [{"input": ln, "output": " war"} for ln in war[:k]])
        assert all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in (" love", " war")), "labels: one token"
        n_test = min(args.n_test, len(rows) // 3)
        train_rows, test_rows = split(rows, n_test)
        recipe = ptune_recipe_from_dict({"template": TEMPLATE, **common, **parse_overrides(args.kw_set)})
        m, train_s = train(model, "kw", train_rows, recipe, work)
        llm.load_task("kw", work / "kw")
        prompts = [TEMPLATE.replace("{input}", r["input"]) for r in test_rows]
        gold = [r["output"] for r in test_rows]
        hand = hand_prompt(tok, recipe.num_virtual_tokens)

        def acc(outs: list[str]) -> float:
            return sum(o == g for o, g in zip(outs, gold)) / len(gold)

        results.append(("keyword classification (accuracy)", acc(first_tokens(llm, prompts, 1, "kw")),
                        acc(first_tokens(llm, prompts, 1)), acc(first_tokens(llm, [hand + p for p in prompts], 1)),
                        0.90, train_s, m, len(train_rows), len(test_rows)))
    if "fmt" in args.tasks.split(","):  # the same inputs, two tags
        inputs = [ln for ln in lines if not LOVE.search(ln)][:1200]
        fmt_train, fmt_test = split(inputs, args.n_test, seed=1)
        fprompts = [x + "\n" for x in fmt_test]
        fmt_over = {"template": "{input}\n", **common, **parse_overrides(args.fmt_set)}
        for tag in args.tags.split(","):
            name = tag.strip(".").lower()
            # "{tag}" in an init_text override becomes this task's tag (a task description per task)
            recipe = ptune_recipe_from_dict({**fmt_over, "init_text": str(fmt_over.get("init_text", "")).replace(
                "{tag}", tag)})
            m, train_s = train(model, name, [{"input": x, "output": tag} for x in fmt_train], recipe, work)
            llm.load_task(name, work / name)

            def comply(outs: list[str], tag: str = tag) -> float:
                return sum(o.lstrip().startswith(tag) for o in outs) / len(outs)

            n_tok = len(tok.encode(tag, add_special_tokens=False)) + 1
            hand_f = hand_prompt(tok, recipe.num_virtual_tokens, f"The next speaker is {tag} ")
            if args.show:
                print(tag, [o for o in first_tokens(llm, fprompts[:args.show], n_tok, name)])
            results.append((f"format: completion starts with {tag!r} (compliance)",
                            comply(first_tokens(llm, fprompts, n_tok, name)), comply(first_tokens(llm, fprompts, n_tok)),
                            comply(first_tokens(llm, [hand_f + p for p in fprompts], n_tok)),
                            0.95, train_s, m, len(fmt_train), len(fmt_test)))
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nCPU: {cpu}; {load}\nmodel: {model}; recipe overrides: common {common}, kw {args.kw_set}, "
          f"fmt {args.fmt_set}; held-out lines never trained on\n")
    print("| task | p-tuned | frozen, no prompt | frozen + hand-written prompt (same N tokens) | target | train s "
          "| steps (stop) | best val loss | train / test |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tuned, plain, handp, target, secs, m, ntr, nte in results:
        ok = "met" if tuned >= target else "MISSED"
        print(f"| {name} | {tuned:.1%} ({ok}) | {plain:.1%} | {handp:.1%} | >= {target:.0%} | {secs:.0f} "
              f"(<= 300) | {m['steps']} ({m['stopped']}) | {m['best_val_loss']:.3f} | {ntr} / {nte} |")


if __name__ == "__main__":
    main()
