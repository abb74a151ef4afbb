"""The training loop: the same function on every data-parallel rank.

    setup     data, model (build_model), optimizer (build_optimizer), state (fresh or resumed)
    step      micro-batches (each rank its slice of the global batch) -> backward -> clip -> AdamW
    report    one all-reduce per step carries the mean loss, the stop flag and rank 0's clock
    periodic  validation loss, checkpoint
    end       final validation, checkpoint, loss curve, export (rank 0 writes files)

SIGTERM and Ctrl-C set a flag; the step in flight finishes, every rank learns of it through the
step's all-reduce, and the run saves a checkpoint and returns, resumable with `resume=True`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engines.core.config import ConfigError
from engines.cpu.host_memory import retain_freed_memory
from training.data import TokenData, TrainOrder, val_starts
from training.distributed import DistContext, StopFlag, init_context, shutdown
from training.metrics import MetricsLog, Progress, plot_loss_curve
from training.model_setup import NextTokenLoss, build_model, wrap_data_parallel
from training.optim import build_optimizer, lr_at, set_lr
from training.precision import autocast, compute_dtype, precision_record
from training.precision import resolve as resolve_precision
from training.recipe import Recipe, grad_accum_steps
from training.state import CHECKPOINT, TrainResult, TrainState, load_state, rng_state, save_state
from training.summary import load_average, training_summary, write_summary

StepCallback = Callable[[TrainState, dict], None]


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenData, starts: np.ndarray, recipe: Recipe, ctx: DistContext,
             precision: str) -> float:
    """Mean next-token loss over the given validation windows, split across ranks (precision: bf16 / fp32)."""
    seq_len, mb = recipe.data.seq_len, recipe.train.micro_batch_size
    mine = starts[ctx.rank::ctx.world_size]
    totals = torch.zeros(2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    loss_fn = NextTokenLoss(model, compute_dtype(precision))
    for i in range(0, len(mine), mb):
        x, y = data.batch("val", mine[i:i + mb], seq_len)
        x, y = x.to(ctx.device), y.to(ctx.device)
        with autocast(precision, ctx.device):
            loss = loss_fn(x, y, reduction="sum")
        totals += torch.tensor([loss.item(), y.numel()], dtype=torch.float64)
    model.train(was_training)
    ctx.all_reduce_sum(totals)
    return (totals[0] / totals[1]).item()


def _save(path: Path, model, optimizer, state: TrainState, recipe: Recipe, data: TokenData,
          ctx: DistContext) -> Path:
    """Every rank contributes its RNG state; rank 0 writes (data-parallel replicas are identical)."""
    gathered = {k: ctx.all_gather(v) for k, v in rng_state(ctx.device).items()}
    states = [{k: gathered[k][r] for k in gathered} for r in range(ctx.world_size)]
    if ctx.is_main:
        save_state(path, model, optimizer, state, recipe, data.fingerprint(), states)
    ctx.barrier()
    return path


def train(recipe: Recipe, resume: bool = False, progress: bool = True, on_step: StepCallback | None = None,
          log=print) -> TrainResult:
    """Train (or resume) `recipe` on this rank; a launcher runs it on every rank."""
    ctx = init_context(recipe.train.device)
    done = False
    try:
        result = _train(recipe, ctx, resume, progress, on_step, log if ctx.is_main else (lambda *a, **k: None))
        done = True
        return result
    finally:
        shutdown(ctx, all_done=done)


def _train(recipe: Recipe, ctx: DistContext, resume: bool, show_progress: bool, on_step: StepCallback | None,
           log) -> TrainResult:
    t = recipe.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    if t.tensor_parallel_size * t.pipeline_parallel_size > 1 or t.recompute != "none":
        from training.parallel.loop import train_parallel  # Megatron layouts: training/parallel/

        return train_parallel(recipe, ctx, resume, show_progress, on_step, log)
    retain_freed_memory()  # reuse freed activation memory instead of page-faulting it back every step
    data = TokenData(recipe.data.dir)
    if recipe.model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size: must be >= the tokenizer's vocabulary ({data.vocab_size}) of "
                          f"{recipe.data.dir}, got {recipe.model.vocab_size}")
    accum = grad_accum_steps(t, ctx.world_size)
    seq_len, mb = recipe.data.seq_len, t.micro_batch_size
    order = TrainOrder(data.meta["train_tokens"], seq_len, t.seed)
    eval_starts = val_starts(data.meta["val_tokens"], seq_len, t.eval_windows)
    # train.final_eval_windows, 0: the whole split
    final_starts = val_starts(data.meta["val_tokens"], seq_len, t.final_eval_windows or data.meta["val_tokens"])

    model = build_model(recipe.model, t.seed, ctx.device, recipe.init)
    optimizer = build_optimizer(model, recipe.optim)
    run_dir = Path(recipe.out.dir)
    ckpt_path = run_dir / CHECKPOINT
    if resume:
        state, exact = load_state(ckpt_path, model, optimizer, recipe, data.fingerprint(), ctx.rank, ctx.world_size)
        log(f"resuming {ckpt_path} at step {state.step}" + ("" if exact else
            " (saved with another world size: dropout streams reseeded, not bitwise)"))
    else:
        if ckpt_path.is_file():
            log(f"fresh run in {run_dir}: its checkpoint will be replaced (--resume continues it instead)")
        state = TrainState()
        torch.manual_seed(t.seed * 1_000_003 + ctx.rank)  # dropout: a different stream per rank
    # train.precision: auto is measured here (a few seconds, outside the time budget), before the clock starts
    choice = resolve_precision(recipe, model, ctx, state.precision if resume else None)
    state.precision = precision = choice.precision
    lm = wrap_data_parallel(NextTokenLoss(model, compute_dtype(precision)), ctx)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {recipe.model.model_type} {recipe.model.n_layer}L x {recipe.model.n_embd}, {n_params / 1e6:.2f}M "
        f"parameters; {ctx.world_size} rank(s) on {ctx.device}, {accum} micro-step(s) of {mb} x {seq_len} tokens "
        f"per rank per step; {recipe.tokens_per_step():,} tokens per step")
    log(f"precision: {precision} ({choice.reason})" + (f"; probe: {choice.rates.describe()}"
                                                        if choice.rates and t.precision != "auto" else ""))
    if choice.warning:
        log(f"warning: {choice.warning}")
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step if resume else None) if ctx.is_main else None
    if metrics:
        metrics.write(precision_record(state.step, t.precision, choice))
    bar = Progress(t.max_steps, state.step, show_progress and ctx.is_main)
    per_rank = t.batch_size // ctx.world_size
    val_loss: float | None = None
    interrupted = False
    load_start = load_average()
    clock = time.perf_counter()
    elapsed0, tokens0, start_step = state.elapsed_s, state.tokens, state.step
    reserve_s = 0.0  # the final evaluation's expected time, kept inside a time budget (if there is one)

    def elapsed_now() -> float:
        return elapsed0 + time.perf_counter() - clock

    recent: deque[tuple[float, int]] = deque(maxlen=6)  # (clock, tokens) after the last steps
    last_frac = 0.0  # the time-budget schedule's progress so far

    def final_eval_estimate() -> float:
        # forward only over the whole val split: a third of a training step's work per token, but it
        # ran only ~2.3x faster than training in fp32 on an AVX2 CPU (75k tokens: 14.2 s, not 10.7 s as
        # 3x predicted, so the run overran its budget); 2x keeps the final evaluation inside it
        now = time.perf_counter()
        rate = (state.tokens - tokens0) / max(1e-9, now - clock)
        recent.append((now, state.tokens))
        if len(recent) > 1:  # a machine that slows down (other jobs start): the recent pace counts
            (t0, n0), (t1, n1) = recent[0], recent[-1]
            rate = min(rate, (n1 - n0) / max(1e-9, t1 - t0))
        return len(final_starts) * seq_len / max(1.0, 2.0 * rate)

    with StopFlag() as stop:
        while state.step < t.max_steps:
            frac = state.step / t.max_steps
            if t.time_budget_s:
                # never backwards: a machine that speeds up again (its reserve shrinks) holds the rate
                frac = last_frac = max(frac, (state.elapsed_s + reserve_s) / t.time_budget_s, last_frac)
                if frac >= 1.0:
                    break
            lr = lr_at(recipe.optim, state.step, t.max_steps, frac if t.time_budget_s else None)
            set_lr(optimizer, lr)
            step_start = time.perf_counter()
            loss_sum = torch.zeros((), device=ctx.device)
            for m in range(accum):
                first = state.samples + ctx.rank * per_rank + m * mb
                x, y = data.batch("train", order.starts(first, mb), seq_len)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                # gradients are all-reduced only on the last micro-step of a step
                sync = lm.no_sync() if ctx.world_size > 1 and m < accum - 1 else contextlib.nullcontext()
                with sync:
                    with autocast(precision, ctx.device):
                        loss = lm(x, y)
                    (loss / accum).backward()
                loss_sum += loss.detach()
            if recipe.optim.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.grad_clip)
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.samples += t.batch_size
            state.tokens += t.batch_size * seq_len
            # one all-reduce: the global mean loss, whether any rank was signalled, rank 0's clocks
            main = ctx.is_main
            shared = torch.tensor([loss_sum.item() / accum, float(stop.set), elapsed_now() if main else 0.0,
                                   final_eval_estimate() if main and t.time_budget_s and t.final_eval else 0.0],
                                  dtype=torch.float64)
            ctx.all_reduce_sum(shared)
            loss_val, stopping = shared[0].item() / ctx.world_size, shared[1].item() > 0
            state.elapsed_s, reserve_s = shared[2].item(), shared[3].item()
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"loss is {loss_val} at step {state.step}; lower optim.lr or check the data")
            step_s = time.perf_counter() - step_start
            record = {"step": state.step, "loss": round(loss_val, 6), "lr": lr, "grad_norm": round(grad_norm.item(), 5),
                      "tokens": state.tokens, "tokens_per_s": round(recipe.tokens_per_step() / step_s, 1),
                      "elapsed_s": round(state.elapsed_s, 3)}
            if metrics and (state.step % t.log_every == 0 or state.step == t.max_steps):
                metrics.write(record)
            expected = t.max_steps
            if t.time_budget_s and state.elapsed_s > elapsed0:
                # the budget may end the run first: the expected last step at the current pace
                pace = (state.step - start_step) / (state.elapsed_s - elapsed0)
                left = max(0.0, t.time_budget_s - reserve_s - state.elapsed_s)
                expected = min(t.max_steps, state.step + round(pace * left))
            bar.update(1, total=expected, loss=loss_val, tok_s=record["tokens_per_s"])
            if on_step is not None:
                on_step(state, record)
            if stopping:
                interrupted = True
                break
            if t.eval_every and state.step % t.eval_every == 0 and state.step < t.max_steps:
                val_loss = evaluate(model, data, eval_starts, recipe, ctx, precision)
                state.best_val_loss = min(val_loss, state.best_val_loss or math.inf)
                if metrics:
                    metrics.write({"step": state.step, "val_loss": round(val_loss, 6), "elapsed_s": round(elapsed_now(), 3)})
                bar.update(0, val=val_loss)
            if t.ckpt_every and state.step % t.ckpt_every == 0 and state.step < t.max_steps:
                _save(ckpt_path, model, optimizer, state, recipe, data, ctx)
        bar.close()
        if interrupted:
            log(f"stopped by signal at step {state.step}; saving {ckpt_path} (continue with --resume)")
        elif t.final_eval:
            val_loss = evaluate(model, data, final_starts, recipe, ctx, precision)
            state.best_val_loss = min(val_loss, state.best_val_loss or math.inf)
            if metrics:
                metrics.write({"step": state.step, "val_loss": round(val_loss, 6), "elapsed_s": round(elapsed_now(), 3)})
        state.elapsed_s = elapsed_now() if ctx.is_main else state.elapsed_s
        _save(ckpt_path, model, optimizer, state, recipe, data, ctx)
    export_dir = None
    if metrics:
        metrics.close()
        plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png",
                        title=f"{recipe.model.model_type} {recipe.model.n_layer}L x {recipe.model.n_embd}, "
                              f"{n_params / 1e6:.1f}M params")
    if not interrupted and recipe.out.export_dir and ctx.is_main:
        from training.export import export_model

        export_dir = export_model(model, recipe.model, recipe.out.export_dir, data.tokenizer_dir,
                                  init_dir=recipe.init or None, overwrite=True)  # the recipe's own earlier export
    if not interrupted and ctx.is_main:
        write_summary(training_summary(recipe, state, val_loss, choice, ctx.device, ctx.world_size,
                                       state.tokens - tokens0, state.elapsed_s - elapsed0, load_start),
                      run_dir, export_dir)
    if not interrupted:
        log(f"done: {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.1f}s ({precision}); "
            + (f"val loss {val_loss:.4f}" if val_loss is not None else "no validation loss")
            + (f"; model exported to {export_dir}" if export_dir else ""))
    ctx.barrier()
    return TrainResult(state, val_loss, interrupted, ckpt_path, export_dir, run_dir)
