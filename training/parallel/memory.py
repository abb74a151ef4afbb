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

from training.parallel.model import ParallelSpec, ParallelStage


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


VARIANTS: list[tuple[str, bool, ParallelSpec]] = [
    # name, uses TP, spec
    ("none", False, ParallelSpec()),
    ("tp", True, ParallelSpec()),
    ("tp_sp", True, ParallelSpec(sequence_parallel=True)),
    ("tp_sar", True, ParallelSpec(recompute="selective")),
    ("tp_sp_sar", True, ParallelSpec(sequence_parallel=True, recompute="selective")),
    ("full", False, ParallelSpec(recompute="full")),
]
LABELS = {"none": "no parallelism", "tp": "TP", "tp_sp": "TP + SP", "tp_sar": "TP + selective",
          "tp_sp_sar": "TP + SP + selective", "full": "full recompute (t=1)"}


def _measure_worker(cfg_dict: dict, s: int, b: int, t: int, out: str) -> None:
    """One rank of a world of t: measure every variant on one micro-batch; rank 0 writes the rows."""
    import json
    import os

    import torch.distributed as dist

    from engines.core.config import ModelConfig
    from training.parallel.groups import Layout, build_groups
    from training.parallel.setup import build_stage

    cfg = ModelConfig(**{**cfg_dict, "eos_token_id": tuple(cfg_dict.get("eos_token_id") or ()), "dropout": 0.0})
    rank = int(os.environ.get("RANK", "0"))
    if t > 1:
        dist.init_process_group("gloo", rank=rank, world_size=t)
    rows = []
    for name, uses_tp, spec in VARIANTS:
        tp = t if uses_tp else 1
        groups = build_groups(Layout.for_world(t, tp, 1), rank)
        stage = build_stage(cfg, 0, groups, spec, torch.device("cpu"))
        x = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
        measured = measure_saved_bytes(stage, x, x).mean
        del stage
        rows.append({"variant": name, "t": tp, "measured": measured,
                     "formula": formula_bytes(name, s, b, cfg.n_embd, cfg.n_head, tp)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if t > 1:
        dist.destroy_process_group()


def memory_report(cfg, s: int, b: int, t: int) -> list[dict]:
    """Measured vs formula bytes per layer for every variant, on t local gloo ranks (fp32, dropout off)."""
    import json
    import tempfile
    from pathlib import Path

    from training.distributed import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        args = (json.loads(json.dumps(cfg.__dict__)), s, b, t, out)
        if t == 1:
            _measure_worker(*args)
        else:
            spawn_local(_measure_worker, t, args)
        return json.loads(Path(out).read_text())


def format_report(rows: list[dict], cfg, s: int, b: int, t: int) -> str:
    h, a = cfg.n_embd, cfg.n_head
    lines = [(f"saved activations per layer: s={s} b={b} h={h} a={a} t={t}; fp32, dropout off "
             f"(Korthikanti et al. 2022, Table 2, adjusted: every term x2 for 4-byte values, dropout masks "
             f"and dropout outputs removed)"),
             (f"{'layout':<22} {'paper (fp16)':<26} {'fp32, no dropout':<26} {'formula MiB':>12} {'measured MiB':>13} "
             f"{'ratio':>7}")]
    for r in rows:
        lines.append(f"{LABELS[r['variant']]:<22} {PAPER[r['variant']]:<26} {ADJUSTED[r['variant']]:<26} "
                     f"{r['formula'] / 2**20:>12.3f} {r['measured'] / 2**20:>13.3f} {r['measured'] / r['formula']:>7.3f}")
    if cfg.model_type != "gpt2" or cfg.activation == "silu" or cfg.ffn_dim != 4 * h or cfg.kv_heads != cfg.n_head:
        lines.append("note: the formulas assume a GPT-2 block (LayerNorm, 4h GELU MLP, multi-head attention); "
                     "this model differs, so only the measured column describes it")
    return "\n".join(lines)
