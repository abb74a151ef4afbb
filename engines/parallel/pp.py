"""Pipeline parallelism: a stage is a contiguous range of a GPT's layers, cut out of the built model.

The first stage embeds, the last applies the final norm and the LM head; activations travel
stage to stage (see engines/runner/model_runner.py). A step's sequences are split into micro-batches so that
stage s works on micro-batch m + 1 while stage s + 1 works on m: with S stages and M
micro-batches the ideal bubble (idle fraction) is (S - 1) / (M + S - 1) instead of (S - 1) / S.
That pays when a stage's time grows with its tokens (prefill, large batches); a small decode
batch is bound by reading the weights, which every micro-batch does again (see
MIN_MICROBATCH_TOKENS).
"""

from __future__ import annotations

import torch
from torch import nn

from engines.core.config import ModelConfig
from engines.core.plan import SeqWork
from engines.model.transformer import head_logits, rope_cache


class StageModel(nn.Module):
    """Layers [start, end) of a GPT, plus the embedding on the first stage and the final norm and
    LM head on the last. Parameter names are the full model's (blocks keyed by global index), so
    the checkpoint plan applies unchanged; each block's attention is renumbered to index the
    stage's own KV cache."""

    def __init__(self, model: nn.Module, start: int, end: int):
        super().__init__()
        cfg: ModelConfig = model.cfg
        self.cfg = cfg
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == cfg.n_layer
        self.wte = model.wte if self.first else None
        self.wpe = model.wpe if self.first else None
        self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        for i, block in self.blocks.items():
            block.attn.layer = int(i) - start
        self.norm_f = model.norm_f if self.last else None
        self.lm_head = model.lm_head if self.last else None

    @property
    def n_layer(self) -> int:
        return self.end - self.start

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: x is token ids (B, T) (or inputs_embeds (B, T, C) replaces their lookup);
        later stages: the previous stage's hidden (B, T, C).
        Returns hidden (B, T, C), after the final norm on the last stage."""
        if self.first:
            h = self.wte(x) if inputs_embeds is None else inputs_embeds  # (B, T, C)
            if self.wpe is not None:
                h = h + self.wpe(positions)
            x = self.drop(h)
        rope = rope_cache(self.cfg, positions) if self.cfg.uses_rope else None
        for block in self.blocks.values():
            x = block(x, rope, backend)
        return self.norm_f(x) if self.last else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self.lm_head, hidden)


def split_stage(model: nn.Module, start: int, end: int) -> StageModel:
    return StageModel(model, start, end)


MIN_MICROBATCH_TOKENS = 64
"""Tokens a micro-batch needs to be compute-bound rather than weight-read-bound: an fp32 matmul
over b tokens does b/2 FLOPs per weight byte, and CPUs and GPUs alike have their roofline ridge
at tens of FLOPs per byte. Below it, each micro-batch re-reads the stage's weights for nothing."""


def split_microbatches(works: list[SeqWork], m: int) -> list[list[int]]:
    """Indices of `works` in m (or fewer) contiguous groups of about equal token counts.

    Contiguous groups keep the step's row order (decode tokens first, then prefill chunks), so
    the last stage sees the rows in the order a single-device runner would.
    """
    if not works:
        return []
    m = max(1, min(m, len(works)))
    sizes = [len(w.token_ids) for w in works]
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    acc = 0
    for i, n in enumerate(sizes):
        left_groups = m - len(groups)
        left_works = len(works) - i
        # close the current group once it reached its share, or when each remaining group needs a work
        if groups[-1] and left_groups > 0 and (acc >= total * len(groups) / m or left_works <= left_groups):
            groups.append([])
        groups[-1].append(i)
        acc += n
    return groups


def ideal_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe forward with equal stages: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def measured_bubble(spans: list[tuple[float, float, float]]) -> float:
    """1 - busy / (ranks x wall) from each rank's (start, end, busy seconds) of the same step(s)."""
    if not spans:
        return 0.0
    wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    busy = sum(b for _, _, b in spans)
    return max(0.0, 1.0 - busy / (len(spans) * wall)) if wall > 0 else 0.0
