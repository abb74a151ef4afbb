"""P-tuning: train a prompt encoder on a frozen base model; save the task PEFT-compatibly.

The base model's parameters have requires_grad=False, so autograd stores no gradient for them
and the optimizer holds state for the encoder only; the metrics report both sizes. Only the
answer tokens carry loss. The best table by validation loss (early stopping) is written as
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
    base_model_hashes,
    check_task_name,
    read_dataset,
    write_task_dir,
)
from training.metrics import MetricsLog, Progress, plot_loss_curve
from training.ptune_recipe import PtuneRecipe


class PromptEncoder(nn.Module):
    """N learned inputs -> (N, hidden) virtual-token embeddings (PEFT's PromptEncoder layouts).

    residual=True adds the input to the mlp/lstm output and zero-initialises the last layer, so
    training starts exactly at the init embeddings (a text init then means its text) and the
    reparameterisation learns a correction; PEFT's layout (residual=False) starts from the
    encoder's random output whatever the init."""

    def __init__(self, kind: str, n: int, hidden: int, enc_hidden: int, init: torch.Tensor | None = None,
                 residual: bool = False):
        super().__init__()
        self.kind, self.residual = kind, residual and kind != "embedding"
        self.embedding = nn.Embedding(n, hidden)
        if init is not None:
            with torch.no_grad():
                self.embedding.weight.copy_(init)
        h = enc_hidden or hidden
        if kind == "mlp":
            self.mlp = nn.Sequential(nn.Linear(hidden, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, hidden))
        elif kind == "lstm":
            self.lstm = nn.LSTM(hidden, h, num_layers=2, bidirectional=True, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(2 * h, 2 * h), nn.ReLU(), nn.Linear(2 * h, hidden))
        if self.residual:
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    def forward(self) -> torch.Tensor:
        e = self.embedding.weight  # (N, C)
        if self.kind == "lstm":
            x = self.mlp(self.lstm(e[None])[0][0])  # (1, N, 2h) -> (N, C)
        elif self.kind == "mlp":
            x = self.mlp(e)
        else:
            return e
        return e + x if self.residual else x


class LayerPrefix(nn.Module):
    """A task of every layer (P-tuning v2): each layer's keys/values of the N virtual tokens,
    (layers, N, 2, KV heads, head_dim), trained directly.

    Inside `hooked(model, prefix.hook)`, every attention layer of the model prepends these to its
    keys/values as those of positions 0..N-1 (after rotary embedding, as the engine's backend
    injects them), so the prompt's tokens attend to them in every layer. The model then runs on the
    real tokens alone, at positions N.. (`model(ids, positions=N + arange(T))`): the virtual
    positions' hidden states would never be read, and skipping them halves a step at N ~ T."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.kv = nn.Parameter(init.clone())

    @classmethod
    def from_text(cls, model, ids: torch.Tensor) -> LayerPrefix:
        """Start from the keys/values the frozen model computes for these N tokens at positions 0..N-1."""
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(layer, k, v):
            got[layer] = (k[0].detach().float(), v[0].detach().float())
            return k, v

        with hooked(model, keep), torch.no_grad():
            model(ids[None])
        return cls(torch.stack([torch.stack(got[i]) for i in range(len(got))]).transpose(1, 2).contiguous())

    def hook(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, T, nkv, hd) of the real tokens -> (B, N + T, nkv, hd) with the prefix in front."""
        B = k.shape[0]
        pk, pv = (self.kv[layer, :, j].to(k.dtype)[None].expand(B, -1, -1, -1) for j in (0, 1))
        return torch.cat([pk, k], 1), torch.cat([pv, v], 1)

    def peft_table(self) -> torch.Tensor:
        """(N, layers * 2 * kv_width) in PEFT's PREFIX_TUNING row layout (layer 0 key, layer 0 value, ...)."""
        return self.kv.detach().permute(1, 0, 2, 3, 4).reshape(self.kv.shape[1], -1).clone()


@contextlib.contextmanager
def hooked(model, fn):
    """While open, every attention layer of `model` calls fn(layer, k, v) -> (k, v)."""
    attns = [b.attn for b in model.blocks]
    for a in attns:
        a.kv_hook = fn
    try:
        yield
    finally:
        for a in attns:
            a.kv_hook = None


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


ProgressFn = Callable[[dict], None]


def train_task(model_dir: str | Path, task: str, data: str | Path, recipe: PtuneRecipe | None = None,
               out_dir: str | Path | None = None, progress: bool = True, resume: bool = False,
               on_progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None) -> dict:
    """Train `task` on `data` (JSONL path or inline JSONL); returns the final metrics.

    on_progress gets {"step", "total", "loss", "elapsed_s", "eta_s"} after every step;
    should_stop() -> True cancels (nothing is written then). The task lands in out_dir,
    by default <model_dir>/ptuning/<task>/."""
    recipe = recipe or PtuneRecipe()
    check_task_name(task)
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else model_dir / "ptuning" / task
    torch.manual_seed(recipe.seed)
    model, cfg = load_model(model_dir)
    model.eval().requires_grad_(False)  # frozen: autograd keeps no gradient for the base
    tok = Tokenizer.from_dir(model_dir)
    if tok is None:
        raise DatasetError(f"model: {str(model_dir)!r} has no tokenizer.json; p-tuning needs text")
    n = recipe.num_virtual_tokens
    precision = resolve_precision(recipe.precision)
    ctx = cfg.max_position_embeddings
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
    init_ids = init_token_ids(recipe, tok, cfg.vocab_size)
    choices = answer_choices(examples, recipe.choice_limit) if recipe.choice_loss else None
    every_layer = recipe.prompt_depth == "every_layer"
    if every_layer:
        enc = LayerPrefix.from_text(model, init_ids)
        table_of = enc.peft_table
        session = hooked(model, enc.hook)
    else:
        init = model.wte.weight[init_ids].detach().clone()  # (N, C)
        enc = PromptEncoder(recipe.encoder, n, cfg.n_embd, recipe.encoder_hidden_size, init, recipe.encoder_residual)
        table_of = lambda: enc().detach().clone()
        session = contextlib.nullcontext()
    if resume and (out / "prompt_encoder.safetensors").is_file():
        enc.load_state_dict(load_file(out / "prompt_encoder.safetensors"))
    # everything is written to a hidden staging folder first: a cancelled or failed run leaves the
    # served task (and the registry's load_dir) untouched
    final, out = out, out.with_name(f".{out.name}.partial")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    enc_path = out / "prompt_encoder.safetensors"
    opt = torch.optim.AdamW(enc.parameters(), lr=recipe.peak_lr, weight_decay=0.0)
    warmup = min(recipe.warmup_steps, recipe.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup, recipe.max_steps))
    log = MetricsLog(out / "metrics.jsonl")
    bar = Progress(recipe.max_steps, 0, progress, desc=f"ptune {task}")
    best = (math.inf, None, 0.0)  # (val loss, table, val accuracy)
    bad_evals, step, t0 = 0, 0, time.perf_counter()
    stopped = "max_steps"
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    enc_bytes = sum(p.numel() * p.element_size() for p in enc.parameters())
    hooks = contextlib.ExitStack()
    try:
        hooks.enter_context(session)
        while step < recipe.max_steps:
            if should_stop is not None and should_stop():
                raise InterruptedError("cancelled")
            batch = [train[rng.randrange(len(train))] for _ in range(min(recipe.batch_size, len(train)))]
            with _autocast(precision):
                loss, _, _ = _batch_loss(model, None if every_layer else enc(), batch, choices, recipe.choice_loss,
                                         prefix=n)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            elapsed = time.perf_counter() - t0
            rec = {"step": step, "loss": loss.item(), "elapsed_s": elapsed}
            if step % recipe.eval_every == 0 or step == recipe.max_steps:
                with torch.no_grad():
                    table = table_of()
                vl, va = evaluate(model, None if every_layer else table, val, recipe.batch_size, precision, n)
                rec.update(val_loss=vl, val_accuracy=va)
                if vl < best[0]:
                    best, bad_evals = (vl, table, va), 0
                    save_file(enc.state_dict(), str(enc_path))
                else:
                    bad_evals += 1
            log.write(rec)
            bar.update(1, loss=rec["loss"], val=rec.get("val_loss"))
            if on_progress is not None:
                on_progress({"step": step, "total": recipe.max_steps, "loss": rec["loss"], "elapsed_s": elapsed,
                             "eta_s": elapsed / step * (recipe.max_steps - step)})
            if recipe.patience and bad_evals >= recipe.patience:
                stopped = "early_stopping"
                break
            if recipe.time_budget_s and elapsed >= recipe.time_budget_s:
                stopped = "time_budget"
                break
        if best[1] is None:  # ended before the first evaluation
            with torch.no_grad():
                table = table_of()
            vl, va = evaluate(model, None if every_layer else table, val, recipe.batch_size, precision, n)
            best = (vl, table, va)
            save_file(enc.state_dict(), str(enc_path))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        hooks.close()
        bar.close()
        log.close()
    metrics = {"steps": step, "stopped": stopped, "precision": precision, "train_seconds": round(time.perf_counter() - t0, 2),
               "best_val_loss": best[0], "val_accuracy": best[2], "train_examples": len(train),
               "val_examples": len(val), "answer_choices": 0 if choices is None else len(choices),
               "base_param_bytes": base_bytes, "trainable_param_bytes": enc_bytes,
               "base_grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                      if p.grad is not None)}
    peft_type = ("PREFIX_TUNING" if every_layer else "PROMPT_TUNING" if recipe.encoder == "embedding"
                 else "P_TUNING")
    write_task_dir(out, task, best[1], base_model=str(model_dir), peft_type=peft_type, shape=ModelShape.of(cfg),
                   encoder_hidden_size=recipe.encoder_hidden_size or cfg.n_embd,
                   meta={**base_model_hashes(model_dir), "template": recipe.template, "metrics": metrics,
                         "recipe": recipe.to_dict()})
    plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png", title=f"p-tuning {task}")
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    return metrics
