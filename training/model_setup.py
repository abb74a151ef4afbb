"""Building the model for training, and the transformations applied to it per parallel layout.

`build_model` makes the engine's GPT (one definition for training and serving);
`wrap_data_parallel` is the data-parallel transformation. Tensor, sequence and pipeline
parallelism are the transformations in training/parallel/ (the built model's Linear layers
sliced with the engines' sharding plan), with the optimizer built on the transformed stage.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.core.config import ConfigError, ModelConfig
from engines.model.transformer import GPT
from training.distributed import DistContext
from training.loss import linear_cross_entropy


def build_model(cfg: ModelConfig, seed: int, device: torch.device, init: str = "") -> GPT:
    """The GPT in train mode (the same weights on every rank): the weights of the model directory
    `init` when given (continued training), else GPT-2 initialisation from `seed`."""
    model = load_pretrained(cfg, init) if init else GPT(cfg).init_weights(seed)
    return model.to(device).train().requires_grad_(True)


def load_pretrained(cfg: ModelConfig, init: str) -> GPT:
    """GPT(cfg) holding the fp32 weights of the model directory `init` (read by the engine's own
    checkpoint reader, so every format and family the engine loads trains). `cfg` is init's config
    (training/recipe.py init_model_config), dropout aside."""
    from engines.loading.checkpoint import CheckpointError, check_shapes, load_state_dict

    try:
        state = load_state_dict(init, cfg, torch.float32)
    except (CheckpointError, FileNotFoundError) as exc:
        raise ConfigError(f"init: {init}: {exc}") from None
    model = GPT(cfg)
    check_shapes(model, state)
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ConfigError(f"init: {init}: checkpoint lacks {', '.join(missing[:5])}")
    return model


class NextTokenLoss(nn.Module):
    """Mean next-token cross-entropy of a batch; the unit that data parallelism wraps.

    The logits are `model.logits(hidden)` (lm_head in `compute_dtype`, read in fp32), fused with
    the loss so the (B*T, V) fp32 logits never exist (training/loss.py). Keeping the loss inside
    one forward lets DistributedDataParallel see every parameter use, the tied lm_head included.
    """

    def __init__(self, model: GPT, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.model = model
        self.compute_dtype = compute_dtype

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        hidden = self.model(idx)  # (B, T, C)
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.model.lm_head.weight,
                                    targets.reshape(-1), self.compute_dtype, reduction)


def wrap_data_parallel(module: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel over ctx.group when there is more than one rank; else the module."""
    if ctx.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, process_group=ctx.group)
