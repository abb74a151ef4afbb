"""Building the model for training, and the transformations applied to it per parallel layout.

`build_model` makes the engine's GPT (one definition for training and serving);
`wrap_data_parallel` is the data-parallel transformation. Tensor and pipeline parallelism will
be further transformations applied between the two (sharding the built model's Linear layers
with the engines' sharding plan), with the optimizer built on the transformed model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import ModelConfig
from engines.model import GPT
from training.distributed import DistContext


def build_model(cfg: ModelConfig, seed: int, device: torch.device) -> GPT:
    """The GPT with GPT-2 initialisation from `seed` (the same weights on every rank), in train mode."""
    model = GPT(cfg).init_weights(seed)
    return model.to(device).train()


class NextTokenLoss(nn.Module):
    """Mean next-token cross-entropy of a batch; the unit that data parallelism wraps.

    Keeping the loss inside one forward lets DistributedDataParallel see every parameter use
    (the tied lm_head included) in its forward pass.
    """

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.model(idx)  # (B, T, C)
        logits = self.model.logits(hidden)  # (B, T, V) fp32
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def wrap_data_parallel(module: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel over ctx.group when there is more than one rank; else the module."""
    if ctx.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, process_group=ctx.group)
