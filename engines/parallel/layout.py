"""Where each shard sits: ranks, stages, and the checks a parallel configuration must pass.

Ranks are laid out Megatron-style with the tensor-parallel ranks of a stage contiguous:
rank = pp_rank * tp + tp_rank. Stage s owns a contiguous range of layers; the last stage, TP rank 0,
samples (it is the only rank whose step result goes back to the driver).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.core.config import ConfigError, EngineConfig, ModelConfig


def check_parallel_config(model: ModelConfig, tp: int, pp: int) -> None:
    """Raise ConfigError, naming the field and the allowed values, if `model` cannot be split tp x pp."""
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"pipeline_parallel_size: must be an integer >= 1, got {pp!r}")
    kv = model.kv_heads
    allowed = allowed_tp_sizes(model)
    if model.n_head % tp:
        raise ConfigError(f"tensor_parallel_size: the model's {model.n_head} attention heads are not divisible "
                          f"by tensor_parallel_size={tp}; allowed: {allowed}")
    if kv % tp and tp % kv:
        raise ConfigError(f"tensor_parallel_size: the model's {kv} key/value heads must be divisible by "
                          f"tensor_parallel_size={tp} (split) or divide it (replicated); allowed: {allowed}")
    if model.ffn_dim % tp:
        raise ConfigError(f"tensor_parallel_size: the MLP width {model.ffn_dim} is not divisible by "
                          f"tensor_parallel_size={tp}; allowed: {allowed}")
    if pp > model.n_layer:
        raise ConfigError(f"pipeline_parallel_size: the model has {model.n_layer} layers, fewer than "
                          f"pipeline_parallel_size={pp} stages; allowed: 1..{model.n_layer}")


def allowed_tp_sizes(model: ModelConfig) -> list[int]:
    """Tensor-parallel sizes the model's heads, key/value heads and MLP width can be split by."""
    kv = model.kv_heads
    return [t for t in range(1, model.n_head + 1)
            if model.n_head % t == 0 and (kv % t == 0 or t % kv == 0) and model.ffn_dim % t == 0]


def head_cost_in_layers(model: ModelConfig) -> float:
    """Decode cost of the LM head relative to one transformer layer (both are matmuls over the
    same tokens: vocab x C weights against the layer's weight count)."""
    c = model.n_embd
    per_layer = c * (model.n_head + 2 * model.kv_heads) * model.hd + model.n_head * model.hd * c + (
        c * model.ffn_dim * (3 if model.activation == "silu" else 2))
    return model.vocab_size * c / per_layer


def stage_layer_ranges(model: ModelConfig, pp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, end) layer ranges, one per stage, balancing decode cost.

    The last stage also runs the LM head, which for GPT-2-sized vocabularies costs several
    layers; the split minimises the slowest stage's cost (layers + head), every stage keeping at
    least one layer. With pp == 1 it is the whole stack.
    """
    n = model.n_layer
    if pp > n:
        raise ConfigError(f"pipeline_parallel_size: the model has {n} layers, fewer than "
                          f"pipeline_parallel_size={pp} stages")
    head = head_cost_in_layers(model)
    # best[s][i]: the smallest possible slowest-stage cost when the first s stages take layers [0, i)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            for j in range(s - 1, i):
                cost = (i - j) + (head if s == pp else 0.0)
                worst = max(best[s - 1][j], cost)
                if worst < best[s][i] - 1e-9:
                    best[s][i], cut[s][i] = worst, j
    bounds = [n]
    for s in range(pp, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return tuple((bounds[s], bounds[s + 1]) for s in range(pp))


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    stages: tuple[tuple[int, int], ...]
    """Layer range [start, end) of each pipeline stage."""

    @classmethod
    def build(cls, model: ModelConfig, tp: int = 1, pp: int = 1) -> ParallelLayout:
        check_parallel_config(model, tp, pp)
        return cls(tp, pp, stage_layer_ranges(model, pp))

    @classmethod
    def from_configs(cls, model: ModelConfig, engine: EngineConfig) -> ParallelLayout:
        return cls.build(model, engine.tensor_parallel_size, engine.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a global rank."""
        return rank % self.tp, rank // self.tp

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        return [self.rank(t, pp_rank) for t in range(self.tp)]

    @property
    def sampler_rank(self) -> int:
        """The one rank whose step result goes back to the driver: last stage, TP rank 0."""
        return self.rank(0, self.pp - 1)

    def microbatches(self, engine: EngineConfig, num_tokens: int) -> int:
        """Micro-batches of a step of num_tokens tokens (see EngineConfig.pipeline_microbatches)."""
        from engines.parallel.pp import MIN_MICROBATCH_TOKENS

        if self.pp == 1:
            return 1
        if engine.pipeline_microbatches:
            return engine.pipeline_microbatches
        return self.pp if num_tokens >= self.pp * MIN_MICROBATCH_TOKENS else 1


def local_kv_heads(model: ModelConfig, tp: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) held by a TP rank: split when there are at least tp of
    them, otherwise each rank keeps the one head its query heads attend to (replicated)."""
    kv = model.kv_heads
    if kv >= tp:
        n = kv // tp
        return tp_rank * n, n
    return tp_rank // (tp // kv), 1


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """Rows of the vocabulary each TP rank holds (the last rank's tail is zero padding)."""
    return -(-model.vocab_size // tp)
