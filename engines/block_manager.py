"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-sequence block tables."""

from __future__ import annotations

import heapq

from engines.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out block ids lowest-first, so a sequence alone gets a contiguous run (the attention
    backend then reads its cache as one slice instead of a gather)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get so that `num_tokens` tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.needed(seq, num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {n}, {len(self._free)} free")
        seq.block_ids.extend(heapq.heappop(self._free) for _ in range(n))

    def free(self, seq: Sequence) -> None:
        for b in seq.block_ids:
            heapq.heappush(self._free, b)
        seq.block_ids = []
