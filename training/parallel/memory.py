"""Measured saved-activation bytes per layer beside Table 2 of Korthikanti et al. 2022.

The paper counts, per transformer layer of a GPT with 16-bit activations and 1-byte dropout masks,
    no parallelism         sbh (34 + 5as/h)
    TP                     sbh (10 + 24/t + 5as/(ht))
    TP + SP                sbh/t (34 + 5as/h)
    TP + selective recomp. sbh (10 + 24/t)
    TP + SP + selective    34 sbh / t
    (full recomputation    2 sbh: the layer's input)
We measure fp32 activations with dropout off, so every 2-byte term doubles and the dropout terms
vanish: the two sbh masks (attention output, MLP output), the as^2 b attention-dropout mask and
the 2as^2 b dropout output that no longer differs from the softmax output. The coefficients
become 34 -> 2 (34 - 2) = 64, 10 -> 2 (10 - 2) = 16, 24 -> 48, 5 -> 2 (5 - 1 - 2) = 4, full 2 -> 4.
The small terms the paper leaves out (LayerNorm mean and 1/std: 16sb bytes) are measured too.

Measurement: a saved-tensor hook over one forward of the stage records every tensor autograd
keeps for backward, skips parameters, counts each storage once (views of one buffer are one
buffer) and attributes it to the layer whose forward is running. The formulas hold for the GPT-2
block (LayerNorm, GELU MLP of 4h, multi-head attention); other families are measured only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from training.parallel.model import ParallelStage


def formula_bytes(variant: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Per-layer activation bytes of Table 2, adjusted to fp32 and dropout off (see module doc)."""
    sbh, att = s * b * h, a * s / h
    return {
        "none": sbh * (64 + 4 * att),
        "tp": sbh * (16 + 48 / t + 4 * att / t),
        "tp_sp": sbh / t * (64 + 4 * att),
        "tp_sar": sbh * (16 + 48 / t),
        "tp_sp_sar": 64 * sbh / t,
        "full": 4 * sbh,
    }[variant]


PAPER = {"none": "sbh(34 + 5as/h)", "tp": "sbh(10 + 24/t + 5as/(ht))", "tp_sp": "sbh/t(34 + 5as/h)",
         "tp_sar": "sbh(10 + 24/t)", "tp_sp_sar": "34sbh/t", "full": "2sbh"}
ADJUSTED = {"none": "sbh(64 + 4as/h)", "tp": "sbh(16 + 48/t + 4as/(ht))", "tp_sp": "sbh/t(64 + 4as/h)",
            "tp_sar": "sbh(16 + 48/t)", "tp_sp_sar": "64sbh/t", "full": "4sbh"}


@dataclass
class LayerBytes:
    per_layer: dict[int, int]
    """Saved bytes attributed to each layer (global index); -1 is the embedding and loss."""

    @property
    def mean(self) -> float:
        layers = [v for k, v in self.per_layer.items() if k >= 0]
        return sum(layers) / max(1, len(layers))


def measure_saved_bytes(stage: ParallelStage, x: torch.Tensor, y: torch.Tensor | None) -> LayerBytes:
    """One forward of `stage` on (x, y) under a saved-tensor hook; the graph is then dropped."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: set[int] = set()
    per_layer: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if isinstance(t, nn.Parameter) or ptr in params or ptr in seen or ptr == 0:
            return t
        seen.add(ptr)
        layer = stage.current_layer
        per_layer[layer] = per_layer.get(layer, 0) + st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x, y)
    del out
    return LayerBytes(per_layer)
