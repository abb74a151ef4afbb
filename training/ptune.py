"""P-tuning: train a prompt encoder on a frozen base model; save the task PEFT-compatibly.

The base model's parameters have requires_grad=False, so autograd stores no gradient for them
and the optimizer holds state for the encoder only; the metrics report both sizes. Only the
answer tokens carry loss. The best table on the validation split (by loss, or by accuracy with ties
by loss: recipe.select_by; early stopping waits on the same score) is written as
`<model>/ptuning/<task>/` (adapter_config.json, adapter_model.safetensors, task.json); the
encoder's own weights sit beside it (prompt_encoder.safetensors) so a run can be resumed.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engines.core.hardware import detect
from engines.loading.checkpoint import load_model
from engines.loading.tokenizer import Tokenizer
from engines.transforms.ptuning import (
    DatasetError,
    ModelShape,
    TaskError,
    base_model_hashes,
    check_task_name,
    read_dataset,
    write_task_dir,
)
from training.metrics import MetricsLog, Progress, plot_loss_curve
from training.ptune_prompt import LayerPrefix, PromptEncoder, hooked
from training.ptune_recipe import PtuneRecipe

__all__ = ["DatasetError", "Example", "LayerPrefix", "PromptEncoder", "Trainer", "evaluate", "hooked",
           "prepare", "train_task", "val_score"]


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    output_ids: list[int]


def tokenize_examples(records: list[dict], tok: Tokenizer, template: str, eos: int | None,
                      max_len: int) -> list[Example]:
    out = []
    for i, rec in enumerate(records, 1):
        ids = tok.encode(template.replace("{input}", rec["input"]))
        ans = tok.encode(rec["output"], add_special_tokens=False) + ([eos] if eos is not None else [])  # no BOS
        if not ids:
            raise DatasetError(f"data example {i}: the prompt encodes to no tokens")
        if len(ids) + len(ans) > max_len:
            raise DatasetError(f"data example {i}: {len(ids)} prompt + {len(ans)} answer tokens exceed the "
                               f"{max_len} the context leaves after the virtual tokens")
        out.append(Example(ids, ans))
    return out


def answer_choices(examples: list[Example], limit: int) -> torch.Tensor | None:
    """The distinct first answer tokens of a classification-like dataset ((K,) ids, 2 <= K <= limit),
    or None when the answers' first tokens take one value or more than `limit` values."""
    firsts = sorted({e.output_ids[0] for e in examples})
    return torch.tensor(firsts) if 2 <= len(firsts) <= limit else None


def _batch_loss(model, table: torch.Tensor | None, batch: list[Example], choices: torch.Tensor | None = None,
                choice_weight: float = 0.0, prefix: int = 0) -> tuple[torch.Tensor, int, int]:
    """Mean answer-token cross-entropy of a batch (plus choice_weight x the cross-entropy of the first
    answer token among `choices` alone), and (answers fully right by argmax, count).

    table: an input task's (N, C) virtual-token embeddings, run in front of each prompt; None: a task
    of every layer, whose `prefix` = N keys/values the open `hooked` session prepends, so the model
    runs on the real tokens alone at positions N.. (LayerPrefix)."""
    seqs = [e.input_ids + e.output_ids[:-1] for e in batch]  # the last answer token is only a target
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    # right padding is harmless under causal attention: no real token attends to a later pad
    if table is None:
        n = 0  # hidden rows are the real tokens'
        hidden = model(ids, positions=torch.arange(prefix, prefix + T).expand(len(batch), T))  # (B, T, C)
    else:
        n = table.shape[0]
        embeds = torch.cat([table[None].expand(len(batch), -1, -1), model.wte(ids)], 1)  # (B, N+T, C)
        hidden = model(torch.zeros(embeds.shape[:2], dtype=torch.long), inputs_embeds=embeds)  # (B, N+T, C)
    rows_b, rows_t, targets, firsts = [], [], [], []
    for b, e in enumerate(batch):
        first = n + len(e.input_ids) - 1  # the row that predicts the first answer token
        firsts.append(len(targets))
        rows_b += [b] * len(e.output_ids)
        rows_t += range(first, first + len(e.output_ids))
        targets += e.output_ids
    logits = model.logits(hidden[rows_b, rows_t]).float()  # (answer tokens, V); fp32 loss under autocast
    tgt = torch.tensor(targets)
    loss = nn.functional.cross_entropy(logits, tgt)
    if choices is not None and choice_weight:
        # the label among the labels alone: its gradient is the classes' difference only, which the
        # full-vocabulary loss buries under the shared "answer with a label" direction (PET's verbaliser loss)
        first_logits = logits[firsts][:, choices]  # (B, K)
        which = torch.searchsorted(choices, tgt[firsts])  # answer_choices gives them sorted
        loss = loss + choice_weight * nn.functional.cross_entropy(first_logits, which)
    right = (logits.argmax(-1) == tgt).tolist()
    k, exact = 0, 0
    for e in batch:
        exact += all(right[k:k + len(e.output_ids)])
        k += len(e.output_ids)
    return loss, exact, len(batch)


def resolve_precision(requested: str) -> str:
    """auto -> bf16 where the CPU has native bf16 matmuls (measured ~2x faster per p-tuning step on
    AVX512-BF16 than fp32), else fp32."""
    if requested != "auto":
        return requested
    return "bf16" if detect("cpu").bf16 else "fp32"


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def evaluate(model, table: torch.Tensor | None, examples: list[Example], batch_size: int,
             precision: str = "fp32", prefix: int = 0) -> tuple[float, float]:
    """(mean answer loss, exact-match accuracy by teacher-forced argmax) over `examples` (table and
    prefix as _batch_loss takes them)."""
    tot, exact = 0.0, 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        with _autocast(precision):
            loss, ex, _ = _batch_loss(model, table, chunk, prefix=prefix)
        tot += loss.item() * len(chunk)
        exact += ex
    return tot / len(examples), exact / len(examples)


def init_token_ids(recipe: PtuneRecipe, tok: Tokenizer, vocab_size: int) -> torch.Tensor:
    """(N,) token ids whose embeddings start the virtual tokens: recipe.init_text's tokens repeated
    or cut to N (PEFT's TEXT init), else N random vocabulary tokens (PEFT's SAMPLE_VOCAB)."""
    n = recipe.num_virtual_tokens
    if recipe.init_text:
        ids = tok.encode(recipe.init_text, add_special_tokens=False)
        if not ids:
            raise DatasetError(f"init_text: {recipe.init_text!r} encodes to no tokens")
        return torch.tensor((ids * (n // len(ids) + 1))[:n])
    return torch.randint(0, vocab_size, (n,))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Learning-rate multiplier before optimizer step `step` (0-based): linear warm-up from 0.1 to 1
    over `warmup` steps, then cosine decay to 0.1 at `total` (a constant rate either jumps around
    the optimum at the end or is too slow at the start; the decay lets a short run settle)."""
    if step < warmup:
        return 0.1 + 0.9 * step / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def val_score(val_loss: float, val_accuracy: float, select_by: str = "loss") -> tuple[float, float]:
    """A validation pass's score, higher is better: (accuracy, -loss) for select_by "accuracy" (the
    loss breaks ties, and alone decides while no answer is fully right), (-loss, accuracy) for "loss"."""
    return (val_accuracy, -val_loss) if select_by == "accuracy" else (-val_loss, val_accuracy)


ProgressFn = Callable[[dict], None]


@dataclass(frozen=True)
class TaskData:
    """A task's frozen base, tokenizer and tokenized split, ready for a Trainer."""
    model: nn.Module
    cfg: object
    tok: Tokenizer
    train: list[Example]
    val: list[Example]
    choices: torch.Tensor | None
    """(K,) label ids for the choice loss, or None."""
    init_ids: torch.Tensor
    """(N,) token ids the virtual tokens start from."""
    rng: random.Random
    """Draws the training batches (seeded by the recipe; the random hold-out, if any, drew first)."""


def prepare(model_dir: str | Path, data: str | Path, recipe: PtuneRecipe) -> TaskData:
    """Load the frozen base and tokenizer, read and tokenize `data`, split train / validation."""
    torch.manual_seed(recipe.seed)
    model, cfg = load_model(Path(model_dir))
    model.eval().requires_grad_(False)  # frozen: autograd keeps no gradient for the base
    tok = Tokenizer.from_dir(model_dir)
    if tok is None:
        raise DatasetError(f"model: {str(model_dir)!r} has no tokenizer.json; p-tuning needs text")
    n, ctx = recipe.num_virtual_tokens, cfg.max_position_embeddings
    if n >= ctx:
        raise DatasetError(f"num_virtual_tokens: {n} leaves no room in the {ctx}-token context")
    records = read_dataset(data, recipe.max_examples)
    eos = cfg.eos_token_id[0] if cfg.eos_token_id else None
    examples = tokenize_examples(records, tok, recipe.template, eos if recipe.append_eos else None, ctx - n)
    rng = random.Random(recipe.seed)
    marked = [i for i, r in enumerate(records) if r.get("split") == "val"]
    if marked and len(marked) < len(records):  # a fixed validation split (training/ptune_tasks.py)
        val = [examples[i] for i in marked]
        train = [examples[i] for i, r in enumerate(records) if r.get("split") != "val"]
    else:
        order = list(range(len(examples)))
        rng.shuffle(order)
        n_val = min(len(examples) - 1, max(1, round(len(examples) * recipe.val_fraction)))
        val = [examples[i] for i in order[:n_val]]
        train = [examples[i] for i in order[n_val:]]
    choices = answer_choices(examples, recipe.choice_limit) if recipe.choice_loss else None
    return TaskData(model, cfg, tok, train, val, choices, init_token_ids(recipe, tok, cfg.vocab_size), rng)


class Trainer:
    """One run's trainable prompt, AdamW and schedule on a frozen base; use as a context manager
    (every_layer's hooks are open inside it).

    step() is one optimizer step (forward, backward, update): its seconds add up in train_s, the
    training clock; evaluate() is a validation pass, its seconds in eval_s. Benchmarks drive step()
    batch by batch, so another trainer can take turns on the same batches."""

    def __init__(self, data: TaskData, recipe: PtuneRecipe):
        self.data, self.recipe = data, recipe
        self.n, self.precision = recipe.num_virtual_tokens, resolve_precision(recipe.precision)
        self.every_layer = recipe.prompt_depth == "every_layer"
        if self.every_layer:
            self.enc = LayerPrefix.from_text(data.model, data.init_ids)
        else:
            init = data.model.wte.weight[data.init_ids].detach().clone()  # (N, C)
            self.enc = PromptEncoder(recipe.encoder, self.n, data.cfg.n_embd, recipe.encoder_hidden_size, init,
                                     recipe.encoder_residual)
        self.opt = torch.optim.AdamW(self.enc.parameters(), lr=recipe.peak_lr, weight_decay=0.0)
        warmup = min(recipe.warmup_steps, recipe.max_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: lr_factor(i, warmup, recipe.max_steps))
        self.steps, self.train_s, self.eval_s = 0, 0.0, 0.0
        self._hooks = contextlib.ExitStack()

    def __enter__(self) -> Trainer:
        if self.every_layer:
            self._hooks.enter_context(hooked(self.data.model, self.enc.hook))
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.close()

    def step(self, batch: list[Example]) -> float:
        """One optimizer step on `batch`; returns its loss."""
        t0 = time.perf_counter()
        with _autocast(self.precision):
            loss, _, _ = _batch_loss(self.data.model, None if self.every_layer else self.enc(), batch,
                                     self.data.choices, self.recipe.choice_loss, prefix=self.n)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        value = loss.item()
        self.steps += 1
        self.train_s += time.perf_counter() - t0
        return value

    @torch.no_grad()
    def table(self) -> torch.Tensor:
        """The task's table as written: (N, C) input embeddings, or every_layer's (N, layers*2*kv) rows."""
        return self.enc.peft_table() if self.every_layer else self.enc().detach().clone()

    def evaluate(self, examples: list[Example]) -> tuple[float, float]:
        """(mean answer loss, teacher-forced exact-match accuracy) on `examples` (not on the training clock)."""
        t0 = time.perf_counter()
        out = evaluate(self.data.model, None if self.every_layer else self.table(), examples, self.recipe.batch_size,
                       self.precision, self.n)
        self.eval_s += time.perf_counter() - t0
        return out


TASK_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors", "task.json", "metrics.jsonl",
                        "loss_curve.png", "prompt_encoder.safetensors"})
"""What train_task writes into a task folder: a folder holding anything else is not ours to replace."""


def check_task_out(model_dir: str | Path, out: str | Path, replace: bool, what: str = "--out",
                   hint: str = "pass --overwrite") -> None:
    """Raise TaskError naming `what` unless a task can be written to `out` losing nothing: `out` is
    new, an empty folder, or (with `replace`) an earlier task folder (task.json and train_task's
    files alone). `out` may not be the model folder or contain it. Cheap: runs before training."""
    p, model = Path(out), Path(model_dir).resolve()
    param = "out" if what.startswith("--") else "task"
    if p.resolve() == model or p.resolve() in model.parents:
        raise TaskError(f"{what}: {str(p)!r} is or contains the model folder {str(model_dir)!r}; writing the task "
                        "there would replace the model; choose a new folder (default: MODEL/ptuning/TASK)", param=param)
    if p.exists() and not p.is_dir():
        raise TaskError(f"{what}: {str(p)!r} is a file, not a folder", param=param)
    names = {e.name for e in p.iterdir()} if p.is_dir() else set()
    if not names:
        return
    if "task.json" not in names or not names <= TASK_FILES or any(e.is_dir() for e in p.iterdir()):
        listing = ", ".join(sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise TaskError(f"{what}: {str(p)!r} is not empty and is not a p-tuned task folder (it holds {listing}); "
                        "choose a new or empty folder (nothing there was changed)", param=param)
    if not replace:
        raise TaskError(f"{what}: {str(p)!r} already holds a trained task; {hint} to replace it", param=param)


def train_task(model_dir: str | Path, task: str, data: str | Path, recipe: PtuneRecipe | None = None,
               out_dir: str | Path | None = None, progress: bool = True, resume: bool = False,
               on_progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
               overwrite: bool = False) -> dict:
    """Train `task` on `data` (JSONL path or inline JSONL); returns the final metrics.

    on_progress gets {"step", "total", "loss", "elapsed_s", "eta_s"} after every step;
    should_stop() -> True cancels (nothing is written then). The task lands in out_dir,
    by default <model_dir>/ptuning/<task>/. metrics: train_seconds is the training clock (the
    optimizer steps alone), eval_seconds the validation passes, wall_seconds both and the rest.

    Before any training, out_dir is checked (check_task_out): an earlier task there is replaced only
    with `overwrite` or `resume` (which continues it); the default folder, the model's own slot for
    `task`, is the REST job's to retrain (ARCHITECTURE.md, P-tuning), so an earlier task there is
    replaced. Any other non-empty folder, a file, or the model folder is refused."""
    recipe = recipe or PtuneRecipe()
    check_task_name(task)
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else model_dir / "ptuning" / task
    check_task_out(model_dir, out, overwrite or resume or out_dir is None,
                   "--out" if out_dir is not None else f"task {task!r}")
    out = out.resolve()  # "." has no name to put the staging folder beside
    td = prepare(model_dir, data, recipe)
    model, cfg, train, val, rng = td.model, td.cfg, td.train, td.val, td.rng
    tr = Trainer(td, recipe)
    if resume and (out / "prompt_encoder.safetensors").is_file():
        tr.enc.load_state_dict(load_file(out / "prompt_encoder.safetensors"))
    # everything is written to a hidden staging folder first: a cancelled or failed run leaves the
    # served task (and the registry's load_dir) untouched
    final, out = out, out.with_name(f".{out.name}.partial")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    enc_path = out / "prompt_encoder.safetensors"
    log = MetricsLog(out / "metrics.jsonl")
    bar = Progress(recipe.max_steps, 0, progress, desc=f"ptune {task}")
    best = (math.inf, None, 0.0)  # (val loss, table, val accuracy) of the selected pass
    best_score, best_step = (-math.inf, -math.inf), 0
    bad_evals, t0 = 0, time.perf_counter()
    stopped = "max_steps"
    try:
        with tr:
            while tr.steps < recipe.max_steps:
                if should_stop is not None and should_stop():
                    raise InterruptedError("cancelled")
                batch = [train[rng.randrange(len(train))] for _ in range(min(recipe.batch_size, len(train)))]
                loss = tr.step(batch)
                step, elapsed = tr.steps, time.perf_counter() - t0
                rec = {"step": step, "loss": loss, "elapsed_s": elapsed, "train_s": tr.train_s}
                if step % recipe.eval_every == 0 or step == recipe.max_steps:
                    vl, va = tr.evaluate(val)
                    rec.update(val_loss=vl, val_accuracy=va)
                    if val_score(vl, va, recipe.select_by) > best_score:
                        best, best_score, best_step = (vl, tr.table(), va), val_score(vl, va, recipe.select_by), step
                        bad_evals = 0
                        save_file(tr.enc.state_dict(), str(enc_path))
                    else:
                        bad_evals += 1
                log.write(rec)
                bar.update(1, loss=loss, val=rec.get("val_loss"))
                if on_progress is not None:
                    on_progress({"step": step, "total": recipe.max_steps, "loss": loss, "elapsed_s": elapsed,
                                 "eta_s": elapsed / step * (recipe.max_steps - step)})
                if recipe.patience and bad_evals >= recipe.patience:
                    stopped = "early_stopping"
                    break
                if recipe.time_budget_s and elapsed >= recipe.time_budget_s:
                    stopped = "time_budget"
                    break
            if best[1] is None:  # ended before the first evaluation
                vl, va = tr.evaluate(val)
                best, best_step = (vl, tr.table(), va), tr.steps
                save_file(tr.enc.state_dict(), str(enc_path))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        bar.close()
        log.close()
    metrics = {"steps": tr.steps, "stopped": stopped, "precision": tr.precision,
               "train_seconds": round(tr.train_s, 3), "eval_seconds": round(tr.eval_s, 3),
               "wall_seconds": round(time.perf_counter() - t0, 3),
               "best_val_loss": best[0], "val_accuracy": best[2], "best_step": best_step,
               "select_by": recipe.select_by, "train_examples": len(train),
               "val_examples": len(val), "answer_choices": 0 if td.choices is None else len(td.choices),
               "base_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "trainable_param_bytes": sum(p.numel() * p.element_size() for p in tr.enc.parameters()),
               "base_grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                      if p.grad is not None)}
    peft_type = ("PREFIX_TUNING" if tr.every_layer else "PROMPT_TUNING" if recipe.encoder == "embedding"
                 else "P_TUNING")
    write_task_dir(out, task, best[1], base_model=str(model_dir), peft_type=peft_type, shape=ModelShape.of(cfg),
                   encoder_hidden_size=recipe.encoder_hidden_size or cfg.n_embd,
                   meta={**base_model_hashes(model_dir), "template": recipe.template, "metrics": metrics,
                         "recipe": recipe.to_dict()})
    plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png", title=f"p-tuning {task}")
    if final.exists():  # checked before training; again, in case it changed meanwhile (the staged task stays)
        check_task_out(model_dir, final, True)
        shutil.rmtree(final)
    out.rename(final)
    return metrics
