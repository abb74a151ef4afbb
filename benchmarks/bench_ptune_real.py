"""P-tuning on a real base against the anchors (issue 39): ours vs PEFT's own trainer vs in-context.

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_ptune_real.py --model models/smollm2 \
        [--tasks play,next_speaker] [--sweep-steps 24] [--steps 80] [--ours-lrs 0.01,0.03,0.1] \
        [--peft-lrs 3e-4,1e-3,3e-3] [--select-by accuracy] [--no-test]

Tasks: training/ptune_tasks.py's "which play" (5 plays) and "who speaks next" (2 named candidates),
with its fixed hash split (80/10/10 by SHA-256 of each example). Every trainer draws its batches
from the whole train split; validation (lr choice, best-state selection, time to accuracy) uses a
fixed stride subset of the val split (--n-val); the whole test split (or, with --n-test N, a stride
subset of N: every k-th example, so every play is in it) is scored ONCE, after the final run. A subset
of 100 is noise for this comparison: the same two trained prompts scored 31.0 % vs 34.0 % on it and
35.7 % vs 29.7 % on all 1,038 (play; the standard error at n = 100 is ~4.6 points a side).

    ours       training.ptune.Trainer, the step train_task (and so a REST job) runs: P-tuning v2 (the
               N virtual tokens' keys/values in every layer, started from the task instruction's text),
               the choice loss, warm-up then cosine decay.
    PEFT       peft.get_peft_model(AutoModelForCausalLM, PromptEncoderConfig(P_TUNING, MLP encoder)),
               PEFT's usual loop: AdamW, linear warm-up then linear decay, loss on the answer tokens
               (its examples tokenized once, as a datasets.map would; each step pads its batch).
    in-context the frozen model, a hand-written instruction plus as many training examples (as chat
               turns) as fit in N tokens: the same prompt budget as the N virtual tokens.

Fairness: one process, one torch thread count, fp32; the same N, batch, step budget and warm-up
length; both trainers take turns step by step on THE SAME batches (train[rng.randrange], seed 0), so
a load change on the shared host hits both alike.

Learning rates: for each trainer, --sweep-steps steps at each rate of its grid (ours' rate i and
PEFT's rate i run interleaved), validation every --eval-every steps; the rate with the highest best
validation accuracy wins (ties: the lower validation loss). The test split is not touched.
--no-test: exploration runs (design choices) train and validate only; the test split is never scored.
--random-init-arm adds a sweep run of ours at its middle rate from random vocabulary embeddings
instead of the text (PEFT's SAMPLE_VOCAB): what the text init buys.

Clock ("training seconds"): the sum over optimizer steps of collation + forward + backward +
optimizer update, for both; validation passes are outside it (reported apart as eval s).

Time to accuracy: both trainers are validated after the same steps (every --eval-every). The target
is PEFT's best validation accuracy in the final run, a_P. For each trainer, T = its training
seconds at the first validation pass with accuracy >= a_P; the ratio is T_ours / T_PEFT (target
<= 0.5x). Undefined when a_P = 0; "never" when ours does not reach a_P. Secondary (defined when a_P = 0 too):
the same with PEFT's best validation loss L_P as the target (first pass with loss <= L_P).

Selection: each trainer's prompt scored on the test split is its validation pass with the lowest
loss (--select-by accuracy: the highest accuracy, ties by loss), as train_task keeps it (recipe
select_by). Each pass scores val's even and odd rows apart too, so the log can check a rule on data
it did not select on: pick the pass by one half, read the other half's accuracy there (both ways).

Test accuracy: all three through the same serving engine (engines.LLM, greedy, <= 16 tokens; ours and
PEFT's selected prompts loaded as tasks, PEFT's as its P_TUNING table): the answer names the right
candidate and no other (in brackets: exactly the label, then EOS). Raw output: runs/bench_ptune_real/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import time
from pathlib import Path

import torch

from training.ptune_tasks import PLAYS

CHATML = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
"""SmolLM2-Instruct's chat turn (tokenizer_config.json's template without the default system turn)."""
INSTRUCTIONS = {
    "play": "Name the play of this line: Hamlet, Macbeth, Romeo and Juliet, Julius Caesar or Twelfth Night. "
            "Title only.",
    "next_speaker": "Answer with the next speaker's name only, one of the two named.",
}
"""The hand-written instruction of each task: the in-context prompt's system turn (30 and 20 tokens with its
markers, so it fits the default budget of 32) and our trainer's init text."""


def stride(rows: list[dict], n: int) -> list[dict]:
    """n rows spread evenly over `rows` (every k-th): a fixed subset that keeps the plays' mix."""
    if n >= len(rows):
        return list(rows)
    k = len(rows) / n
    return [rows[int(i * k)] for i in range(n)]


def in_context_prefix(tok, task: str, train: list[dict], budget: int) -> tuple[list[int], int]:
    """(token ids of a system turn with the instruction + as many example turns as fit in `budget`, examples)."""
    ids = tok.encode(f"<|im_start|>system\n{INSTRUCTIONS[task]}<|im_end|>\n", add_special_tokens=False)
    if len(ids) > budget:  # the instruction alone, cut to the budget
        return ids[:budget], 0
    seen, order = set(), []  # one example per answer first (play: each title once), then in split order
    for r in train:
        if r["output"] not in seen:
            seen.add(r["output"])
            order.append(r)
    n = 0
    for r in order + [r for r in train if r not in order]:
        turn = tok.encode(CHATML.replace("{input}", r["input"]) + r["output"] + "<|im_end|>\n",
                          add_special_tokens=False)
        if len(ids) + len(turn) > budget:
            break
        ids, n = ids + turn, n + 1
    return ids, n


def candidates(task: str, row: dict) -> list[str]:
    """The answers a row's prompt allows: the five titles, or the two speakers the prompt names."""
    if task == "play":
        return list(PLAYS.values())
    return list(re.fullmatch(r"Who speaks next, (.+) or (.+)\?", row["input"].rsplit("\n", 1)[1]).groups())


def names_only(text: str, right: str, others: list[str]) -> bool:
    """text names `right` and no other candidate (case-insensitive; a candidate inside `right` is fine)."""
    t = text.lower()
    return right.lower() in t and not any(o.lower() in t for o in others if o != right and o.lower() not in right.lower())


def engine_accuracy(llm, tok, task: str, rows: list[dict], prefix: list[int], name: str | None,
                    max_tokens: int = 16) -> dict:
    """Greedy completions through the serving engine: {"named": share naming the right candidate and no
    other, "exact": share that are exactly the label followed by EOS, "samples": the first few}."""
    from engines import SamplingParams

    prompts = [prefix + tok.encode(CHATML.replace("{input}", r["input"])) for r in rows]
    outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                                               task=name)]
    named = [names_only(o.text, r["output"], candidates(task, r)) for o, r in zip(outs, rows)]
    exact = [o.text.strip() == r["output"] and o.finish_reason == "stop" for o, r in zip(outs, rows)]
    return {"named": sum(named) / len(rows), "exact": sum(exact) / len(rows),
            "samples": [[r["output"], o.text] for o, r in zip(outs[:8], rows)]}


def _encode(tok, row: dict, eos: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + EOS) of a row in PEFT's loop (the prompt as our trainer templates it)."""
    return tok.encode(CHATML.replace("{input}", row["input"])), tok.encode(row["output"], add_special_tokens=False) + [eos]


def _pad(pairs: list[tuple[list[int], list[int]]], pad: int):
    """(input_ids, attention_mask, labels): right-padded; labels -100 on the prompt and padding."""
    T = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), T), pad, dtype=torch.long)
    lab = torch.full((len(pairs), T), -100, dtype=torch.long)
    mask = torch.zeros(len(pairs), T, dtype=torch.long)
    for b, (p, a) in enumerate(pairs):
        s = p + a
        ids[b, :len(s)], lab[b, len(p):len(s)], mask[b, :len(s)] = torch.tensor(s), torch.tensor(a), 1
    return ids, mask, lab


def _peft_batch(tok, rows: list[dict], eos: int, pad: int):
    """_pad of rows tokenized now (benchmarks/bench_ptune_step.py's PEFT step)."""
    return _pad([_encode(tok, r, eos) for r in rows], pad)


class Ours:
    """training.ptune.Trainer on prepared task data; rows are looked up by their input text."""

    def __init__(self, td, recipe, by_text: dict):
        from training.ptune import Trainer

        self.tr, self.by_text = Trainer(td, recipe).__enter__(), by_text

    def step(self, rows: list[dict]) -> float:
        return self.tr.step([self.by_text[r["input"]] for r in rows])

    def evaluate(self, rows: list[dict]) -> tuple[float, float]:
        return self.tr.evaluate([self.by_text[r["input"]] for r in rows])

    def snapshot(self) -> torch.Tensor:
        return self.tr.table()

    @property
    def train_s(self) -> float:
        return self.tr.train_s

    def close(self) -> None:
        self.tr.__exit__(None, None, None)


class Peft:
    """PEFT's P-tuning (MLP PromptEncoder) on transformers, its usual loop, on pre-tokenized rows."""

    def __init__(self, model: Path, n: int, lr: float, steps: int, warmup: int, cache: dict):
        from peft import PromptEncoderConfig, get_peft_model
        from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

        from engines.loading.tokenizer import Tokenizer

        self.tok = Tokenizer.from_dir(model)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        torch.manual_seed(0)
        self.pm = get_peft_model(base, PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=n,
                                                           encoder_hidden_size=base.config.hidden_size))
        e = base.config.eos_token_id
        self.eos = e if isinstance(e, int) else e[0]
        self.pad = base.config.pad_token_id if base.config.pad_token_id is not None else self.eos
        self.opt = torch.optim.AdamW([p for p in self.pm.parameters() if p.requires_grad], lr=lr)
        self.sched = get_linear_schedule_with_warmup(self.opt, warmup, steps)
        self.cache, self.n, self.train_s, self.eval_s = cache, n, 0.0, 0.0
        self.pm.train()

    def _enc(self, rows: list[dict]):
        return [self.cache.setdefault(r["input"], _encode(self.tok, r, self.eos)) for r in rows]

    def step(self, rows: list[dict]) -> float:
        pairs = self._enc(rows)  # tokenized once (the first sight is before the clock)
        t0 = time.perf_counter()
        ids, mask, lab = _pad(pairs, self.pad)
        loss = self.pm(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        value = loss.item()
        self.train_s += time.perf_counter() - t0
        return value

    @torch.no_grad()
    def evaluate(self, rows: list[dict], batch: int = 8) -> tuple[float, float]:
        """(mean answer loss, share whose teacher-forced argmax is the label + EOS) in PEFT's forward."""
        t0, tot, right = time.perf_counter(), 0.0, 0
        self.pm.eval()
        for i in range(0, len(rows), batch):
            ids, mask, lab = _pad(self._enc(rows[i:i + batch]), self.pad)
            out = self.pm(input_ids=ids, attention_mask=mask, labels=lab)
            tot += out.loss.item() * ids.shape[0]
            pred, tgt = out.logits[:, self.n:-1].argmax(-1), lab[:, 1:]  # (B, T-1): the prediction of token t+1
            right += ((pred == tgt) | (tgt == -100)).all(-1).sum().item()
        self.pm.train()
        self.eval_s += time.perf_counter() - t0
        return tot / len(rows), right / len(rows)

    def snapshot(self) -> dict:
        return {k: v.detach().clone() for k, v in self.pm.prompt_encoder.state_dict().items()}

    def table(self, snapshot: dict) -> torch.Tensor:
        """(N, hidden) virtual-token embeddings of an encoder snapshot: the encoder's output."""
        self.pm.prompt_encoder.load_state_dict(snapshot)
        with torch.no_grad():
            return self.pm.get_prompt_embedding_to_save("default")  # (N, hidden): the encoder's output

    def close(self) -> None:
        pass


def interleaved(trainers: dict, batches: list[list[dict]], val: list[dict], every: int, log,
                select_by: str = "loss") -> tuple[dict, dict]:
    """Each batch: every trainer's step in turn; every `every` steps (and the last) a validation pass
    of each, on val's two halves (even / odd rows) apart. Returns ({name: [{"step", "train_s", "loss",
    "val_loss", "val_accuracy", "halves": [[loss, acc] of each half]}]}, {name: (step, snapshot)} of
    the pass that val_score(select_by) ranks best on the whole of val)."""
    from training.ptune import val_score

    halves = [val[0::2], val[1::2]]
    evals: dict[str, list[dict]] = {k: [] for k in trainers}
    best: dict[str, tuple] = {}
    losses: dict[str, float] = {}
    for i, rows in enumerate(batches, 1):
        for name, t in trainers.items():
            losses[name] = t.step(rows)
        if i % every == 0 or i == len(batches):
            for name, t in trainers.items():
                hv = [t.evaluate(h) for h in halves]
                vl = sum(l * len(h) for (l, _), h in zip(hv, halves)) / len(val)
                va = sum(a * len(h) for (_, a), h in zip(hv, halves)) / len(val)
                evals[name].append({"step": i, "train_s": t.train_s, "loss": losses[name], "val_loss": vl,
                                    "val_accuracy": va, "halves": [list(x) for x in hv]})
                score = val_score(vl, va, select_by)
                if name not in best or score > best[name][0]:
                    best[name] = (score, i, t.snapshot())
            log(f"  step {i}: " + "; ".join(f"{k} loss {losses[k]:.3f} val {e[-1]['val_loss']:.3f} "
                                           f"acc {e[-1]['val_accuracy']:.3f} train {e[-1]['train_s']:.0f} s"
                                           for k, e in evals.items()) + f"; load {os.getloadavg()[0]:.1f}")
    return evals, {k: v[1:] for k, v in best.items()}


def cross_check(evals: list[dict]) -> dict:
    """Which selection rule picks the better pass for data it did not see: for each rule, pick the pass
    by one half of val and take the other half's accuracy there (both ways, averaged). Validation only."""
    from training.ptune import val_score

    out = {}
    for rule in ("accuracy", "loss"):
        got = []
        for sel, other in ((0, 1), (1, 0)):
            e = max(evals, key=lambda e: val_score(*e["halves"][sel], rule))
            got.append(e["halves"][other][1])
        out[rule] = sum(got) / 2
    out["final_step"] = sum(evals[-1]["halves"][o][1] for o in (0, 1)) / 2
    return out


def batches(train: list[dict], batch: int, steps: int) -> list[list[dict]]:
    """The batches train_task draws with seed 0: train[rng.randrange(len(train))], `batch` at a time."""
    rng = random.Random(0)
    return [[train[rng.randrange(len(train))] for _ in range(batch)] for _ in range(steps)]


def time_to(evals: list[dict], acc: float) -> float | None:
    """Training seconds at the first validation pass with accuracy >= acc (None: never)."""
    return next((e["train_s"] for e in evals if e["val_accuracy"] >= acc - 1e-9), None)


def time_to_loss(evals: list[dict], loss: float) -> float | None:
    """Training seconds at the first validation pass with loss <= loss (None: never)."""
    return next((e["train_s"] for e in evals if e["val_loss"] <= loss + 1e-9), None)


def pick(runs: dict[float, list[dict]]) -> float:
    """The rate whose run reached the highest validation accuracy (ties: the lower validation loss)."""
    return max(runs, key=lambda lr: max((e["val_accuracy"], -e["val_loss"]) for e in runs[lr]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2")
    ap.add_argument("--tasks", default="play,next_speaker")
    ap.add_argument("--virtual-tokens", type=int, default=32, help="N, and the in-context prompt budget")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps of the final run, both trainers")
    ap.add_argument("--sweep-steps", type=int, default=24,
                    help="steps of each sweep run (0: no sweep); short sweeps favour high rates (play: 24 steps "
                         "picked ours' 0.1, 80 steps 0.01)")
    ap.add_argument("--ours-lrs", default="0.01,0.03,0.1", help="our sweep grid (the first alone: no sweep)")
    ap.add_argument("--peft-lrs", default="3e-4,1e-3,3e-3",
                    help="PEFT's sweep grid (its P-tuning examples use 1e-3; 1e-2 was its worst on play's validation)")
    ap.add_argument("--random-init-arm", action="store_true",
                    help="sweep also ours at its middle rate from random vocabulary embeddings (what the text init buys)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up steps, both trainers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--n-val", type=int, default=64)
    ap.add_argument("--n-test", type=int, default=0, help="test examples scored (0: the whole split)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--select-by", choices=("loss", "accuracy"), default="loss",
                    help="which validation pass's prompt each trainer keeps for the test (training.ptune.val_score)")
    ap.add_argument("--no-test", action="store_true",
                    help="exploration: train and validate only; the test split is not read or scored")
    ap.add_argument("--out", default="runs/bench_ptune_real")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from benchmarks.common import cpu_line
    from engines import LLM
    from engines.transforms.ptuning import ModelShape, base_model_hashes, write_task_dir
    from training.ptune import prepare
    from training.ptune_recipe import ptune_recipe_from_dict
    from training.ptune_tasks import build_tasks
    from training.shakespeare import shakespeare_files

    model, work = Path(args.model).resolve(), Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(work / "log.txt", "a") as f:
            f.write(msg + "\n")

    def recipe(task: str, lr: float, steps: int, **kw):
        return ptune_recipe_from_dict({
            "num_virtual_tokens": args.virtual_tokens, "max_steps": steps, "batch_size": args.batch,
            "warmup_steps": args.warmup, "template": CHATML, "init_text": INSTRUCTIONS[task], "precision": "fp32",
            "patience": 0, "seed": 0, "lr": lr, **kw})

    log(f"CPU: {cpu_line()}; torch threads {args.threads}; fp32; load {os.getloadavg()}")
    splits = build_tasks(shakespeare_files())
    results: dict[str, dict] = {}
    for task in args.tasks.split(","):
        train, val = splits[task]["train"], stride(splits[task]["val"], args.n_val)
        test = [] if args.no_test else stride(splits[task]["test"], args.n_test or len(splits[task]["test"]))
        log(f"[{task}] train {len(train)}, val {len(val)} of {len(splits[task]['val'])}, "
            f"test {len(test)} of {len(splits[task]['test'])}")
        data = work / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in train + [{**r, "split": "val"} for r in val]))
        td = prepare(model, data, recipe(task, 0.03, 1))
        by_text = {r["input"]: e for r, e in zip(train + val, td.train + td.val)}
        cache: dict = {}

        ours_lrs = [float(x) for x in args.ours_lrs.split(",")]
        peft_lrs = [float(x) for x in args.peft_lrs.split(",")]
        sweep: dict[str, dict] = {"ours": {}, "peft": {}, "ours_random_init": {}}
        if args.sweep_steps and (len(ours_lrs) > 1 or len(peft_lrs) > 1):
            for i in range(max(len(ours_lrs), len(peft_lrs))):
                t: dict = {}
                if i < len(ours_lrs):
                    t["ours"] = Ours(td, recipe(task, ours_lrs[i], args.sweep_steps), by_text)
                if i < len(peft_lrs):
                    t["peft"] = Peft(model, args.virtual_tokens, peft_lrs[i], args.sweep_steps, args.warmup, cache)
                log(f"[{task}] sweep {i}: ours lr {ours_lrs[i] if 'ours' in t else '-'}, "
                    f"PEFT lr {peft_lrs[i] if 'peft' in t else '-'}")
                ev, _ = interleaved(t, batches(train, args.batch, args.sweep_steps), val, args.eval_every, log,
                                    args.select_by)
                for k, tr in t.items():
                    sweep[k][(ours_lrs if k == "ours" else peft_lrs)[i]] = ev[k]
                    tr.close()
        if args.sweep_steps and args.random_init_arm:
            mid = ours_lrs[len(ours_lrs) // 2]
            log(f"[{task}] sweep: ours lr {mid} from random vocabulary embeddings (no init text)")
            rand = torch.randint(0, td.cfg.vocab_size, (args.virtual_tokens,), generator=torch.Generator().manual_seed(0))
            r = Ours(dataclasses.replace(td, init_ids=rand), recipe(task, mid, args.sweep_steps, init_text=""), by_text)
            sweep["ours_random_init"][mid] = interleaved({"ours": r}, batches(train, args.batch, args.sweep_steps), val,
                                                         args.eval_every, log, args.select_by)[0]["ours"]
            r.close()
        lr_o = pick(sweep["ours"]) if sweep["ours"] else ours_lrs[0]
        lr_p = pick(sweep["peft"]) if sweep["peft"] else peft_lrs[0]
        log(f"[{task}] final: ours lr {lr_o}, PEFT lr {lr_p}, {args.steps} steps, interleaved")
        ours = Ours(td, recipe(task, lr_o, args.steps), by_text)
        peft = Peft(model, args.virtual_tokens, lr_p, args.steps, args.warmup, cache)
        ev, best = interleaved({"ours": ours, "peft": peft}, batches(train, args.batch, args.steps), val,
                               args.eval_every, log, args.select_by)
        ours.close()
        chosen = {k: {"step": v[0], **next({"val_loss": e["val_loss"], "val_accuracy": e["val_accuracy"]}
                                            for e in ev[k] if e["step"] == v[0])} for k, v in best.items()}
        checks = {k: cross_check(e) for k, e in ev.items()}
        log(f"[{task}] selected ({args.select_by}): {json.dumps(chosen)}; half-vs-half check of the rules "
            f"(accuracy on the half not used to select): {json.dumps(checks)}")
        a_p = max(e["val_accuracy"] for e in ev["peft"])
        t_o, t_p = time_to(ev["ours"], a_p), time_to(ev["peft"], a_p)
        l_p = min(e["val_loss"] for e in ev["peft"])  # the secondary target: PEFT's best validation loss
        tl_o, tl_p = time_to_loss(ev["ours"], l_p), time_to_loss(ev["peft"], l_p)
        prefix, n_examples = in_context_prefix(td.tok, task, train, args.virtual_tokens)
        test_scores = None
        if not args.no_test:  # the test split, once: each trainer's selected prompt through the engine
            write_task_dir(work / "ours" / task, task, best["ours"][1], base_model=str(model),
                           peft_type="PREFIX_TUNING", shape=ModelShape.of(td.cfg),
                           meta={**base_model_hashes(model), "template": CHATML})
            write_task_dir(work / "peft" / task, task, peft.table(best["peft"][1]), base_model=str(model),
                           peft_type="P_TUNING", meta=base_model_hashes(model))
            del peft, ours
            llm = LLM(str(model))
            llm.load_task(task, work / "ours" / task)
            llm.load_task(f"peft-{task}", work / "peft" / task)
            test_scores = {"ours": engine_accuracy(llm, td.tok, task, test, [], task),
                           "peft": engine_accuracy(llm, td.tok, task, test, [], f"peft-{task}"),
                           "in_context": engine_accuracy(llm, td.tok, task, test, prefix, None)}
            del llm
        del td
        results[task] = {"lr": {"ours": lr_o, "peft": lr_p}, "sweep": {k: {str(lr): e for lr, e in v.items()}
                                                                     for k, v in sweep.items()},
                         "final": ev, "selected": chosen, "selection_check": checks, "peft_best_val_acc": a_p, "time_to": {"ours": t_o, "peft": t_p},
                         "peft_best_val_loss": l_p, "time_to_loss": {"ours": tl_o, "peft": tl_p},
                         "test": test_scores, "n": {"train": len(train), "val": len(val), "test": len(test)},
                         "in_context_examples": n_examples, "in_context_tokens": len(prefix),
                         "load_end": os.getloadavg()}
        if test_scores is not None:
            log(f"[{task}] test: " + json.dumps({k: {m: v[m] for m in ("named", "exact")}
                                                 for k, v in test_scores.items()}))
        (work / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    lines = [f"CPU: {cpu_line()}; torch threads {args.threads}; fp32; load at the end {os.getloadavg()}",
             (f"model: {model}; N = {args.virtual_tokens}; final {args.steps} steps of batch {args.batch}, "
              f"validation every {args.eval_every} on {args.n_val}; sweep {args.sweep_steps} steps a rate"), "",
             ("| task | test n | ours | PEFT | in-context (examples) | ours - PEFT (>= 0) | ours - in-context (>= +20) "
              "| lr ours / PEFT | PEFT best val acc | train s to it, ours / PEFT (<= 0.5x) "
              "| train s to PEFT's best val loss, ours / PEFT | selected val acc (step), ours / PEFT |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = lambda c: "met" if c else "MISSED"
    for task, r in results.items():
        nan = float("nan")  # --no-test: the test columns stay empty
        t = {k: v["named"] for k, v in r["test"].items()} if r["test"] else dict.fromkeys(r["selected"] | {"in_context": 0}, nan)
        ex = {k: v["exact"] for k, v in r["test"].items()} if r["test"] else t
        sel = " / ".join(f"{r['selected'][k]['val_accuracy']:.1%} ({r['selected'][k]['step']})" for k in ("ours", "peft"))
        to, tp = r["time_to"]["ours"], r["time_to"]["peft"]
        ratio = ("n/a: PEFT's val acc stayed 0" if r["peft_best_val_acc"] <= 0 else
                 f"ours never reached it (PEFT {tp:.0f} s)" if to is None else
                 f"{to:.0f} / {tp:.0f} s = **{to / tp:.2f}x** ({ok(to / tp <= 0.5)})")
        lo, lp = r["time_to_loss"]["ours"], r["time_to_loss"]["peft"]
        lratio = (f"{r['peft_best_val_loss']:.2f}: ours never" if lo is None else
                  f"{r['peft_best_val_loss']:.2f}: {lo:.0f} / {lp:.0f} s = {lo / lp:.2f}x")
        lines.append(
            f"| {task} | {r['n']['test']} | {t['ours']:.1%} ({ex['ours']:.1%}) | {t['peft']:.1%} ({ex['peft']:.1%}) "
            f"| {t['in_context']:.1%} ({ex['in_context']:.1%}; {r['in_context_examples']}) "
            f"| {100 * (t['ours'] - t['peft']):+.1f} ({ok(t['ours'] >= t['peft'])}) "
            f"| {100 * (t['ours'] - t['in_context']):+.1f} ({ok(t['ours'] - t['in_context'] >= 0.2)}) "
            f"| {r['lr']['ours']:g} / {r['lr']['peft']:g} | {r['peft_best_val_acc']:.1%} | {ratio} | {lratio} | {sel} |")
    log("\n" + "\n".join(lines))
    (work / "table.md").write_text("\n".join(lines) + "\n")
    log(f"raw output: {work}")


if __name__ == "__main__":
    main()
