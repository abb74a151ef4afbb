"""Pipeline schedules over micro-batches: 1F1B (PipeDream-flush, Megatron's default) and GPipe.

A step's micro-batches flow stage to stage; each stage sends its output activations (T[/t], b, C)
to the same (tp_rank, dp_rank) of the next stage and receives the gradient of them back. Sends
are non-blocking (isend) and waited for at the end of the step, so no pair of ranks can block on
each other's send; receives block. Messages are tagged by micro-batch and direction.

1F1B: stage s runs (S - s - 1) warm-up forwards, then alternates one forward and one backward,
then drains the rest: at most S micro-batches' activations alive on stage s, against M for GPipe
(all forwards, then all backwards). Both have the ideal bubble (S - 1) / (M + S - 1); the loss is
divided by M once per micro-batch on the last stage, so the step's gradient is the mean.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from training.parallel.model import ParallelStage

Schedule = Literal["1f1b", "gpipe"]
BWD_TAG = 1 << 20


def ideal_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a pipeline step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass
class StepStats:
    loss_sum: float
    """Sum of the micro-batches' mean losses (last stage; 0 elsewhere)."""
    wait_s: float
    """Seconds this rank spent blocked on receives (its share of the bubble plus transfer)."""
    step_s: float


def run_step(stage: ParallelStage, batches: list[tuple[torch.Tensor, torch.Tensor]], schedule: Schedule,
             hidden_shape: tuple[int, ...], amp: Callable[[], object]) -> StepStats:
    """Forward and backward of every micro-batch (x, y) of a step on this stage; gradients accumulate.

    hidden_shape: the activation a stage passes on, (T[/t], micro_batch, C). amp() makes the
    autocast context of the forward.
    """
    g = stage.groups
    M = len(batches)
    t0 = time.perf_counter()
    wait = 0.0
    sends: list = []
    dtype = next(stage.parameters()).dtype
    device = next(stage.parameters()).device
    in_flight: deque = deque()
    loss_sum = 0.0

    def recv(src_stage: int, tag: int) -> torch.Tensor:
        nonlocal wait
        buf = torch.empty(hidden_shape, dtype=dtype, device=device)
        w = time.perf_counter()
        dist.recv(buf, src=g.stage_rank(src_stage), tag=tag)
        wait += time.perf_counter() - w
        return buf

    def forward(m: int) -> None:
        nonlocal loss_sum
        x, y = batches[m]
        inp = x if stage.first else recv(g.pp_rank - 1, m).requires_grad_()
        with amp():
            out = stage(inp, y if stage.last else None)
        if stage.last:
            loss_sum += out.item()
            out = out / M
        else:
            sends.append((dist.isend(out.detach().contiguous(), dst=g.stage_rank(g.pp_rank + 1), tag=m), out))
        in_flight.append((m, inp, out))

    def backward() -> None:
        m, inp, out = in_flight.popleft()
        if stage.last:
            out.backward()
        else:
            out.backward(recv(g.pp_rank + 1, BWD_TAG + m))
        if not stage.first:
            sends.append((dist.isend(inp.grad.contiguous(), dst=g.stage_rank(g.pp_rank - 1), tag=BWD_TAG + m),
                          inp.grad))

    if g.layout.pp == 1:
        for m in range(M):
            forward(m)
            backward()
    elif schedule == "gpipe":
        for m in range(M):
            forward(m)
        for _ in range(M):
            backward()
    else:
        warmup = min(g.layout.pp - g.pp_rank - 1, M)
        for m in range(warmup):
            forward(m)
        for m in range(warmup, M):
            forward(m)
            backward()
        while in_flight:
            backward()
    for work, _ in sends:
        work.wait()
    return StepStats(loss_sum, wait, time.perf_counter() - t0)


@torch.no_grad()
def forward_only(stage: ParallelStage, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 hidden_shape: tuple[int, ...], amp: Callable[[], object]) -> float:
    """Evaluation through the pipeline: the sum of the micro-batches' mean losses (last stage; 0 elsewhere)."""
    g = stage.groups
    device, dtype = next(stage.parameters()).device, next(stage.parameters()).dtype
    total, sends = 0.0, []
    for m, (x, y) in enumerate(batches):
        if stage.first:
            inp = x
        else:
            inp = torch.empty(hidden_shape, dtype=dtype, device=device)
            dist.recv(inp, src=g.stage_rank(g.pp_rank - 1), tag=m)
        with amp():
            out = stage(inp, y if stage.last else None)
        if stage.last:
            total += out.item()
        else:
            out = out.contiguous()
            sends.append((dist.isend(out, dst=g.stage_rank(g.pp_rank + 1), tag=m), out))
    for work, _ in sends:
        work.wait()
    return total
