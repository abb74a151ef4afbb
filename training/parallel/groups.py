"""The process groups of a training layout: tensor (TP) x data (DP) x pipeline (PP) parallel.

Ranks are laid out Megatron-style, TP fastest: rank = (pp_rank * dp + dp_rank) * tp + tp_rank, so
a TP group is contiguous (on one host under NCCL) and a stage's ranks are contiguous. Every rank
creates every group in the same order (torch.distributed requires it), then keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engines.core.config import ConfigError


@dataclass(frozen=True)
class Layout:
    """A TP x PP x DP split of `world` ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def for_world(cls, world: int, tp: int, pp: int) -> Layout:
        if world % (tp * pp):
            raise ConfigError(f"train.tensor_parallel_size x train.pipeline_parallel_size: {tp} x {pp} = {tp * pp} "
                              f"does not divide the {world} ranks (--num-workers); data parallel = world / (TP x PP) "
                              f"must be a whole number")
        return cls(tp, pp, world // (tp * pp))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


@dataclass(frozen=True)
class Groups:
    """This rank's place in the layout and the groups it talks in. A group of one is None (every
    collective on it is the identity), so layers run unchanged in a single process."""

    layout: Layout
    rank: int = 0
    tp_group: Any = None
    dp_group: Any = None
    mp_group: Any = None
    """TP x PP ranks of one data-parallel replica: the global gradient norm is summed over it."""
    embed_group: Any = None
    """First and last stage of one (tp_rank, dp_rank): the tied embedding's gradients are summed over it."""

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the same (tp_rank, dp_rank) on stage pp_rank (pipeline neighbours)."""
        return self.layout.rank(self.tp_rank, self.dp_rank, pp_rank)


def build_groups(layout: Layout, rank: int) -> Groups:
    """Create every group of `layout` (collective over the default group) and keep this rank's."""
    if layout.world == 1:
        return Groups(layout, 0)
    L = layout
    mine: dict[str, Any] = {}

    def make(name: str, ranks: list[int]) -> None:
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine[name] = g

    for pp in range(L.pp):
        for dp in range(L.dp):
            make("tp_group", [L.rank(t, dp, pp) for t in range(L.tp)])
    for pp in range(L.pp):
        for t in range(L.tp):
            make("dp_group", [L.rank(t, dp, pp) for dp in range(L.dp)])
    for dp in range(L.dp):
        make("mp_group", [L.rank(t, dp, pp) for pp in range(L.pp) for t in range(L.tp)])
    for dp in range(L.dp):
        for t in range(L.tp):
            make("embed_group", sorted({L.rank(t, dp, 0), L.rank(t, dp, L.pp - 1)}))
    return Groups(L, rank, **mine)
