"""`train.precision`: which precision a run trains in, chosen by measurement where asked.

    auto   on CPU, time a forward + backward of the recipe's own shapes (its model, seq_len, a
           slice of its micro-batch) in bf16 autocast and in fp32, and train in the faster;
           on CUDA, bf16 where the GPU has it (engines/core/hardware.py, the helper the engine's
           dtype="auto" uses too)
    bf16   bf16 autocast, as configured; a warning names both rates if it measures much slower
    fp32   fp32, likewise

A resumed `auto` run keeps the precision its checkpoint was trained in (the choice is part of the
trajectory). Every rank measures and the rates are averaged, so all ranks choose alike.
"""

from __future__ import annotations

import torch

from engines.core.hardware import Choice, Hardware, Rates, RunFn, choose_precision, detect, time_precisions
from training.distributed import DistContext
from training.model_setup import NextTokenLoss
from training.recipe import Recipe

PROBE_TOKENS = 1024
"""Tokens per timed probe call: the recipe's micro-batch is cut to about this many (whole rows),
so both precisions are timed in a few seconds even where bf16 is emulated."""
PROBE_BUDGET_S = 4.0


def autocast(precision: str, device: torch.device):
    """bf16 autocast for "bf16", a no-op region for "fp32" (never "auto": resolve it first)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=_concrete(precision) == "bf16")


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if _concrete(precision) == "bf16" else torch.float32


def _concrete(precision: str) -> str:
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision: expected bf16 or fp32 (auto is resolved by training.precision.resolve), "
                         f"got {precision!r}")
    return precision


def training_probe(model: torch.nn.Module, vocab_size: int, device: torch.device) -> RunFn:
    """run(precision, batch, seq_len): one forward + backward of the training loss on random
    tokens, gradients dropped after; the global RNG (dropout) is left as it was."""

    def run(precision: str, batch: int, seq_len: int) -> None:
        gen = torch.Generator().manual_seed(batch * 7919 + seq_len)
        x = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
        y = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with autocast(precision, device):
                loss = NextTokenLoss(model, compute_dtype(precision))(x, y)
            loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def probe_shape(recipe: Recipe) -> tuple[int, int]:
    """(rows, seq_len) of a probe call: the recipe's window length, up to its micro-batch of rows."""
    seq_len = recipe.data.seq_len
    return min(recipe.train.micro_batch_size, max(1, PROBE_TOKENS // seq_len)), seq_len


def measure(recipe: Recipe, model: torch.nn.Module, ctx: DistContext) -> Rates:
    """Both rates on this rank's device, averaged over the ranks (cached per process)."""
    rows, seq_len = probe_shape(recipe)
    key = ("train", str(ctx.device), recipe.model, rows, seq_len, torch.get_num_threads())
    local = time_precisions(training_probe(model, recipe.model.vocab_size, ctx.device), rows, seq_len,
                            budget_s=PROBE_BUDGET_S, key=key)
    shared = torch.tensor([local.bf16, local.fp32, local.seconds], dtype=torch.float64)
    ctx.all_reduce_sum(shared)
    bf16, fp32, seconds = (shared / ctx.world_size).tolist()
    return Rates(bf16=bf16, fp32=fp32, seconds=seconds)


def resolve(recipe: Recipe, model: torch.nn.Module, ctx: DistContext, resumed: str | None = None,
            hardware: Hardware | None = None, measure_fn=None) -> Choice:
    """The precision this run trains in. `resumed`: the precision a resumed checkpoint recorded;
    `hardware` / `measure_fn` stand in for the machine's (tests)."""
    requested = recipe.train.precision
    hardware = hardware or detect(ctx.device)
    if requested == "auto" and resumed in ("bf16", "fp32"):
        return Choice(resumed, f"auto: {resumed}, as the resumed checkpoint was trained")
    rates = (measure_fn or measure)(recipe, model, ctx) if hardware.device_type == "cpu" else None
    return choose_precision(requested, hardware, rates)


def describe(choice: Choice) -> str:
    return f"precision {choice.precision} ({choice.reason})"


def precision_record(step: int, requested: str, choice: Choice) -> dict:
    """The metrics.jsonl line of the choice (step: where the run starts)."""
    record = {"step": step, "precision": choice.precision, "requested_precision": requested,
              "precision_reason": choice.reason}
    if choice.rates is not None:
        record.update(bf16_tokens_per_s=round(choice.rates.bf16, 1), fp32_tokens_per_s=round(choice.rates.fp32, 1),
                      probe_s=round(choice.rates.seconds, 3))
    if choice.warning:
        record["precision_warning"] = choice.warning
    return record
