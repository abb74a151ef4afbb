"""The training loop on a Megatron layout (TP x PP x DP, SP, recomputation).

The same shape as training/trainer.py's data-parallel loop (warmup + cosine, clipping, periodic
evaluation and checkpoints, SIGTERM saves), with the step run by the pipeline schedule:

    per step   accum micro-batches (x, y) of this DP rank -> run_step (1F1B / GPipe)
               -> sync_grads (SP norms, tied embedding, DP mean) -> clip (global norm) -> AdamW
    report     one all-reduce: the loss (from the last stage), the stop flag, rank 0's clock
    checkpoint every rank writes its shard: out.dir/checkpoint/rank-<r>.safetensors (parameters,
               AdamW state, both RNG streams) and rank 0 writes layout.json; --resume needs the
               same recipe (layout keys included) and the same number of ranks
    export     the shards are gathered into one model on rank 0 and written HF-compatible
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open

from training.data import TokenData, TrainOrder, val_starts
from training.distributed import DistContext, StopFlag
from training.metrics import MetricsLog, Progress, plot_loss_curve
from training.optim import build_optimizer, lr_at, set_lr
from training.parallel.grads import clip_grads, sync_grads
from training.parallel.groups import Layout, build_groups
from training.parallel.model import ParallelSpec, ParallelStage
from training.parallel.schedule import forward_only, ideal_bubble, run_step
from training.parallel.setup import build_stage, check_layout
from training.parallel.state import gather_model
from training.recipe import Recipe, grad_accum_steps
from training.state import ResumeError, TrainResult, TrainState, load_state, rng_state, save_state

SHARDS = "checkpoint"


def spec_of(recipe: Recipe) -> ParallelSpec:
    t = recipe.train
    return ParallelSpec(t.sequence_parallel, t.recompute, t.recompute_layers)


def _shard_path(run_dir: Path, rank: int) -> Path:
    return run_dir / SHARDS / f"rank-{rank:05d}.safetensors"


def _save(run_dir: Path, stage: ParallelStage, optimizer, state: TrainState, recipe: Recipe, data: TokenData,
          ctx: DistContext) -> Path:
    states = {**rng_state(ctx.device), "tracker": stage.tracker.state}
    save_state(_shard_path(run_dir, ctx.rank), stage, optimizer, state, recipe, data.fingerprint(), [states])
    if ctx.is_main:
        L = stage.groups.layout
        (run_dir / SHARDS / "layout.json").write_text(json.dumps({"world": L.world, "tp": L.tp, "pp": L.pp,
                                                                  "dp": L.dp, "step": state.step}))
    ctx.barrier()
    return run_dir / SHARDS


def _resume(run_dir: Path, stage: ParallelStage, optimizer, recipe: Recipe, data: TokenData,
            ctx: DistContext) -> TrainState:
    layout_file = run_dir / SHARDS / "layout.json"
    if not layout_file.is_file():
        raise ResumeError(f"no parallel checkpoint in {run_dir / SHARDS} to resume from")
    saved = json.loads(layout_file.read_text())
    L = stage.groups.layout
    if saved["world"] != L.world:
        raise ResumeError(f"{run_dir / SHARDS} was written by {saved['world']} ranks (TP {saved['tp']} x PP "
                          f"{saved['pp']} x DP {saved['dp']}); resume with --num-workers {saved['world']}")
    path = _shard_path(run_dir, ctx.rank)
    state, _ = load_state(path, stage, optimizer, recipe, data.fingerprint(), 0, 1)
    with safe_open(path, framework="pt") as f:
        stage.tracker.state = f.get_tensor("rng.0.tracker")
    return state


def _evaluate(stage, data, starts, recipe, ctx, dp_rank, dp, shape, amp) -> float:
    mb, seq_len = recipe.train.micro_batch_size, recipe.data.seq_len
    mine = starts[dp_rank::dp]
    n = len(mine) // mb * mb or len(mine)  # whole micro-batches (every stage must see the same count)
    batches = [data.batch("val", mine[i:i + mb], seq_len) for i in range(0, n, mb)]
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches if len(x) == mb]
    was = stage.training
    stage.eval()
    total = forward_only(stage, batches, shape, amp)
    stage.train(was)
    g = stage.groups
    t = torch.tensor([total * mb if stage.last and g.tp_rank == 0 else 0.0,
                      len(batches) * mb if stage.last and g.tp_rank == 0 else 0.0], dtype=torch.float64)
    ctx.all_reduce_sum(t)
    return (t[0] / t[1]).item()


def train_parallel(recipe: Recipe, ctx: DistContext, resume: bool, show_progress: bool, on_step, log):
    from training.precision import autocast, choose_precision, describe, detect

    t = recipe.train
    tp, pp = t.tensor_parallel_size, t.pipeline_parallel_size
    check_layout(recipe.model, recipe.data.seq_len, tp, pp, t.sequence_parallel, ctx.world_size)
    layout = Layout.for_world(ctx.world_size, tp, pp)
    groups = build_groups(layout, ctx.rank)
    data = TokenData(recipe.data.dir)
    accum = grad_accum_steps(t, ctx.world_size)
    seq_len, mb = recipe.data.seq_len, t.micro_batch_size
    order = TrainOrder(data.meta["train_tokens"], seq_len, t.seed)
    eval_starts = val_starts(data.meta["val_tokens"], seq_len, t.eval_windows)
    final_starts = val_starts(data.meta["val_tokens"], seq_len, t.final_eval_windows or data.meta["val_tokens"])
    # the default stream draws the masks of replicated tensors: the same within a TP group
    torch.manual_seed(t.seed * 1_000_003 + groups.dp_rank)
    stage = build_stage(recipe.model, t.seed, groups, spec_of(recipe), ctx.device, recipe.init)
    optimizer = build_optimizer(stage, recipe.optim)
    run_dir = Path(recipe.out.dir)
    state = _resume(run_dir, stage, optimizer, recipe, data, ctx) if resume else TrainState()
    if resume:
        log(f"resuming {run_dir / SHARDS} at step {state.step}")
    shape = (seq_len // tp if t.sequence_parallel else seq_len, mb, recipe.model.n_embd)
    # precision auto on a parallel layout: the hardware rule (bf16 only on bf16 hardware), no probe: a
    # stage is not the whole model the probe times
    choice = choose_precision(t.precision, detect(ctx.device))
    log(describe(choice))
    amp = lambda: autocast(choice.precision, ctx.device)
    bubble = ideal_bubble(pp, accum)
    log(f"layout: TP {tp} x PP {pp} x DP {layout.dp}" + (" + SP" if t.sequence_parallel else "") +
        f", recompute {t.recompute}; {accum} micro-batch(es) of {mb} x {seq_len} per step, schedule "
        f"{t.pipeline_schedule}, ideal bubble {bubble:.1%}")
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step if resume else None) if ctx.is_main else None
    bar = Progress(t.max_steps, state.step, show_progress and ctx.is_main)
    per_rank = t.batch_size // layout.dp
    clock, elapsed0 = time.perf_counter(), state.elapsed_s
    val_loss, interrupted = None, False
    reports = stage.last and groups.tp_rank == 0
    with StopFlag() as stop:
        while state.step < t.max_steps:
            lr = lr_at(recipe.optim, state.step, t.max_steps)
            set_lr(optimizer, lr)
            start = time.perf_counter()
            batches = []
            for m in range(accum):
                x, y = data.batch("train", order.starts(state.samples + groups.dp_rank * per_rank + m * mb, mb),
                                  seq_len)
                batches.append((x.to(ctx.device), y.to(ctx.device)))
            stats = run_step(stage, batches, t.pipeline_schedule, shape, amp)
            sync_grads(stage)
            grad_norm = clip_grads(stage, recipe.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.samples += t.batch_size
            state.tokens += t.batch_size * seq_len
            shared = torch.tensor([stats.loss_sum / accum if reports else 0.0, float(stop.set),
                                   time.perf_counter() - clock + elapsed0 if ctx.is_main else 0.0,
                                   stats.wait_s / stats.step_s], dtype=torch.float64)
            ctx.all_reduce_sum(shared)
            loss_val, stopping = shared[0].item() / layout.dp, shared[1].item() > 0
            state.elapsed_s = shared[2].item()
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"loss is {loss_val} at step {state.step}; lower optim.lr or check the data")
            step_s = time.perf_counter() - start
            record = {"step": state.step, "loss": round(loss_val, 6), "lr": lr, "grad_norm": round(grad_norm.item(), 5),
                      "tokens": state.tokens, "tokens_per_s": round(recipe.tokens_per_step() / step_s, 1),
                      "elapsed_s": round(state.elapsed_s, 3), "bubble_ideal": round(bubble, 4),
                      "recv_wait_frac": round(shared[3].item() / ctx.world_size, 4)}
            if metrics and (state.step % t.log_every == 0 or state.step == t.max_steps):
                metrics.write(record)
            bar.update(1, loss=loss_val, tok_s=record["tokens_per_s"])
            if on_step is not None:
                on_step(state, record)
            if stopping:
                interrupted = True
                break
            if t.eval_every and state.step % t.eval_every == 0 and state.step < t.max_steps:
                val_loss = _evaluate(stage, data, eval_starts, recipe, ctx, groups.dp_rank, layout.dp, shape, amp)
                if metrics:
                    metrics.write({"step": state.step, "val_loss": round(val_loss, 6)})
            if t.ckpt_every and state.step % t.ckpt_every == 0 and state.step < t.max_steps:
                _save(run_dir, stage, optimizer, state, recipe, data, ctx)
        bar.close()
        if not interrupted and t.final_eval:
            val_loss = _evaluate(stage, data, final_starts, recipe, ctx, groups.dp_rank, layout.dp, shape, amp)
            if metrics:
                metrics.write({"step": state.step, "val_loss": round(val_loss, 6)})
        ckpt = _save(run_dir, stage, optimizer, state, recipe, data, ctx)
    export_dir = None
    full = gather_model(stage) if recipe.out.export_dir and not interrupted else None
    if metrics:
        metrics.close()
        plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png",
                        title=f"{recipe.model.model_type} TP{tp} x PP{pp} x DP{layout.dp}")
    if full is not None and ctx.is_main:
        export_dir = export_full(full, recipe)
    log(f"done: {state.step} steps on TP {tp} x PP {pp} x DP {layout.dp}" +
        (f"; val loss {val_loss:.4f}" if val_loss is not None else "") +
        (f"; model exported to {export_dir}" if export_dir else ""))
    ctx.barrier()
    return TrainResult(state, val_loss, interrupted, ckpt, export_dir, run_dir)


def export_full(full: dict[str, torch.Tensor], recipe: Recipe) -> Path:
    """One HF-compatible model directory from the gathered tensors, whatever the layout."""
    from engines.model.transformer import GPT
    from training.export import export_model

    model = GPT(recipe.model)
    missing, unexpected = model.load_state_dict(full, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and recipe.model.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"gathered shards do not make the model: missing {missing}, unexpected {unexpected}")
    return export_model(model.eval(), recipe.model, recipe.out.export_dir, TokenData(recipe.data.dir).tokenizer_dir,
                        init_dir=recipe.init or None, overwrite=True)  # the recipe's own earlier export
