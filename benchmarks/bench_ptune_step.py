"""Where a p-tuning step's time goes: ours against PEFT's loop on the same batches (issue 39).

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_ptune_step.py [--model models/smollm2] \
        [--task play] [--steps 4] [--virtual-tokens 32] [--batch 8]

One process, one torch thread count, fp32, the task data of training/ptune_tasks.py (the batches our
trainer draws: train[rng.randrange(len(train))], seed 0). Three trainers take turns on each batch
(interleaved, so a load change on a shared host hits all three alike), and each step is cut into
collation (token ids to padded tensors; our examples are tokenized once before training, PEFT's
loop tokenizes each batch), forward + loss, backward, and the optimizer step:

    ours         training.ptune's step as train_task runs it (P-tuning v2 of every layer, the recipe's
                 defaults: choice loss, text init): the model runs on the real tokens alone, the N
                 virtual tokens' keys/values prepended in every layer (LayerPrefix)
    ours-before  the same, the way it ran before that change: the model also ran on the N virtual
                 positions (their hidden states computed and never read; their keys/values replaced)
    PEFT         peft.get_peft_model(AutoModelForCausalLM, PromptEncoderConfig(P_TUNING, MLP encoder)),
                 PEFT's usual loop (benchmarks/bench_ptune_real.py's, loss on the answer tokens)

The first round is a warm-up (not counted); the medians of the others are printed with the ratio
to PEFT's step. Raw output: runs/bench_ptune_step/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_ptune_real import CHATML, INSTRUCTIONS, _peft_batch
from benchmarks.common import cpu_line

PHASES = ("collate", "forward", "backward", "optimizer")


class Clock:
    """Seconds per phase of one step (perf_counter marks)."""

    def __init__(self):
        self.t, self.out = time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.out[phase] = now - self.t
        self.t = now


def ours_trainer(model_dir: Path, task: str, train_rows: list[dict], n: int, before: bool):
    """step(rows) -> phase seconds, for our trainer's every-layer step (before: the old full-length run)."""
    from engines.loading.checkpoint import load_model
    from engines.loading.tokenizer import Tokenizer
    from training.ptune import (
        LayerPrefix,
        _batch_loss,
        answer_choices,
        hooked,
        init_token_ids,
        tokenize_examples,
    )
    from training.ptune_recipe import ptune_recipe_from_dict

    recipe = ptune_recipe_from_dict({"num_virtual_tokens": n, "template": CHATML, "init_text": INSTRUCTIONS[task],
                                     "precision": "fp32", "lr": 0.03})
    model, cfg = load_model(model_dir)
    model.eval().requires_grad_(False)
    tok = Tokenizer.from_dir(model_dir)
    eos = cfg.eos_token_id[0]
    by_text = {r["input"]: e for r, e in zip(train_rows, tokenize_examples(
        train_rows, tok, recipe.template, eos, cfg.max_position_embeddings - n))}  # once, as train_task does
    choices = answer_choices(list(by_text.values()), recipe.choice_limit)
    enc = LayerPrefix.from_text(model, init_token_ids(recipe, tok, cfg.vocab_size))
    opt = torch.optim.AdamW(enc.parameters(), lr=recipe.peak_lr, weight_decay=0.0)

    def old_hook(layer, k, v):  # the old contract: k/v hold the N virtual positions first, replaced
        pk, pv = (enc.kv[layer, :, j].to(k.dtype)[None].expand(k.shape[0], -1, -1, -1) for j in (0, 1))
        return torch.cat([pk, k[:, n:]], 1), torch.cat([pv, v[:, n:]], 1)

    inputs = torch.zeros(n, cfg.n_embd)  # the old path's virtual inputs (never read)

    def step(rows: list[dict]) -> dict:
        c = Clock()
        batch = [by_text[r["input"]] for r in rows]
        c.mark("collate")  # our padding happens inside _batch_loss (counted in forward)
        with hooked(model, old_hook if before else enc.hook):
            if before:
                loss, _, _ = _batch_loss(model, inputs, batch, choices, recipe.choice_loss)
            else:
                loss, _, _ = _batch_loss(model, None, batch, choices, recipe.choice_loss, prefix=n)
            c.mark("forward")
            opt.zero_grad(set_to_none=True)
            loss.backward()
        c.mark("backward")
        opt.step()
        c.mark("optimizer")
        T = max(len(e.input_ids) + len(e.output_ids) - 1 for e in batch)  # the last answer token: a target only
        return {**c.out, "positions": T + (n if before else 0)}  # positions the model runs on, per row

    return step


def peft_trainer(model_dir: Path, n: int, lr: float = 3e-3):
    from peft import PromptEncoderConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engines.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    pm = get_peft_model(base, PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=n,
                                                  encoder_hidden_size=base.config.hidden_size))
    eos = base.config.eos_token_id if isinstance(base.config.eos_token_id, int) else base.config.eos_token_id[0]
    pad = base.config.pad_token_id if base.config.pad_token_id is not None else eos
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr)
    pm.train()

    def step(rows: list[dict]) -> dict:
        c = Clock()
        ids, mask, lab = _peft_batch(tok, rows, eos, pad)
        c.mark("collate")
        loss = pm(input_ids=ids, attention_mask=mask, labels=lab).loss
        c.mark("forward")
        loss.backward()
        c.mark("backward")
        opt.step()
        opt.zero_grad()
        c.mark("optimizer")
        return {**c.out, "positions": n + ids.shape[1]}

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2")
    ap.add_argument("--task", default="play", choices=tuple(INSTRUCTIONS))
    ap.add_argument("--virtual-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed rounds after one warm-up round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="runs/bench_ptune_step")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from training.ptune_tasks import build_tasks
    from training.shakespeare import shakespeare_files

    model = Path(a.model).resolve()
    train = build_tasks(shakespeare_files())[a.task]["train"]
    rng = random.Random(0)
    batches = [[train[rng.randrange(len(train))] for _ in range(a.batch)] for _ in range(a.steps + 1)]
    trainers = {"ours": ours_trainer(model, a.task, train, a.virtual_tokens, before=False),
                "ours-before": ours_trainer(model, a.task, train, a.virtual_tokens, before=True),
                "PEFT": peft_trainer(model, a.virtual_tokens)}
    threads = torch.get_num_threads()
    load0 = os.getloadavg()
    times: dict[str, list[dict]] = {k: [] for k in trainers}
    for i, rows in enumerate(batches):
        for name, step in trainers.items():
            r = step(rows)
            if i:
                times[name].append(r)
            print(f"round {i}{' (warm-up)' if not i else ''} {name}: " + ", ".join(
                f"{p} {r[p]:.2f}" for p in PHASES) + f" s; positions {r['positions']} x {a.batch}", flush=True)
    load1 = os.getloadavg()
    med = {k: {p: statistics.median(r[p] for r in v) for p in PHASES} for k, v in times.items()}
    for m in med.values():
        m["step"] = sum(m[p] for p in PHASES)
    lines = [(f"CPU: {cpu_line()}; torch threads {threads} (the same for all three); fp32; load average "
              f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end"),
             (f"model {model}; task {a.task}; N = {a.virtual_tokens}; batch {a.batch}; median of {a.steps} "
              "interleaved rounds after one warm-up"), "",
             "| trainer | collate s | forward s | backward s | optimizer s | step s | / PEFT's step |",
             "|---|---|---|---|---|---|---|"]
    for k, m in med.items():
        lines.append(f"| {k} | " + " | ".join(f"{m[p]:.3f}" for p in PHASES) +
                     f" | **{m['step']:.2f}** | {m['step'] / med['PEFT']['step']:.2f}x |")
    text = "\n".join(lines)
    print("\n" + text)
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(a), "steps": times, "median": med}, indent=1))
    print(f"\nraw output: {out}")


if __name__ == "__main__":
    main()
