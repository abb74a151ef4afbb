"""Checking a training layout and building this rank's stage of the model."""

from __future__ import annotations

import torch

from engines.core.config import ConfigError, ModelConfig
from engines.model.transformer import GPT
from engines.parallel.layout import allowed_tp_sizes, stage_layer_ranges
from training.parallel.groups import Groups
from training.parallel.model import ParallelSpec, ParallelStage
from training.parallel.rng import RNGTracker, tracker_seed


def check_layout(cfg: ModelConfig, seq_len: int, tp: int, pp: int, sequence_parallel: bool,
                 world: int | None = None) -> None:
    """Raise ConfigError naming the recipe key when `cfg` cannot be trained on this layout."""
    allowed = allowed_tp_sizes(cfg)
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"train.tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"train.pipeline_parallel_size: must be an integer >= 1, got {pp!r}")
    if cfg.n_head % tp:
        raise ConfigError(f"train.tensor_parallel_size: the model's {cfg.n_head} attention heads (model.n_head) "
                          f"are not divisible by {tp}; allowed: {allowed}")
    if cfg.kv_heads % tp:
        raise ConfigError(f"train.tensor_parallel_size: the model's {cfg.kv_heads} key/value heads "
                          f"(model.n_kv_head) are not divisible by {tp} (training splits them; replicating "
                          f"them would need their gradients summed); allowed: "
                          f"{[t for t in allowed if cfg.kv_heads % t == 0]}")
    if cfg.ffn_dim % tp:
        raise ConfigError(f"train.tensor_parallel_size: the MLP width {cfg.ffn_dim} (model.intermediate_size) "
                          f"is not divisible by {tp}; allowed: {allowed}")
    if cfg.vocab_size % tp:
        raise ConfigError(f"model.vocab_size: {cfg.vocab_size} is not divisible by train.tensor_parallel_size={tp} "
                          f"(the vocabulary is split evenly); use e.g. {-(-cfg.vocab_size // (64 * tp)) * 64 * tp}")
    if sequence_parallel and seq_len % tp:
        raise ConfigError(f"data.seq_len: {seq_len} is not divisible by train.tensor_parallel_size={tp}, which "
                          f"train.sequence_parallel needs (each rank holds seq_len / {tp} positions)")
    if pp > cfg.n_layer:
        raise ConfigError(f"train.pipeline_parallel_size: the model has {cfg.n_layer} layers (model.n_layer), "
                          f"fewer than {pp} stages; allowed: 1..{cfg.n_layer}")
    if world is not None and world % (tp * pp):
        raise ConfigError(f"--num-workers: {world} ranks are not divisible by train.tensor_parallel_size x "
                          f"train.pipeline_parallel_size = {tp} x {pp}; data parallel = world / (TP x PP)")


def build_stage(cfg: ModelConfig, seed: int, groups: Groups, spec: ParallelSpec, device: torch.device,
                init: str = "") -> ParallelStage:
    """The full model initialised from `seed` (the single-process weights), or read from the model
    directory `init`, cut to this rank's shard.

    Every rank builds the whole model once so that any layout starts from the same weights as one
    process; only its shard is kept.
    """
    from training.model_setup import load_pretrained

    model = (load_pretrained(cfg, init) if init else GPT(cfg).init_weights(seed)).train()
    start, end = stage_layer_ranges(cfg, groups.layout.pp)[groups.pp_rank]
    tracker = RNGTracker(tracker_seed(seed, groups.tp_rank, groups.dp_rank, groups.pp_rank), device)
    stage = ParallelStage(model, groups, spec, start, end, tracker)
    del model
    return stage.to(device).train()
