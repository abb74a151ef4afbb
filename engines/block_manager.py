"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-sequence block tables.

Placement keeps each sequence's blocks contiguous whenever the pool allows, because the CPU
attention backend then reads a sequence's keys and values as one slice of the cache, in place,
instead of gathering them (on 2 cores the gather cost 10x the attention itself):

- a sequence's first block opens a *reservation*: a run of free blocks sized for its whole
  expected length (prompt + max_tokens, capped by the context window), taken first-fit among
  the unreserved free runs, else the largest one;
- each later block extends the sequence in place (the next block id) when that block is free
  and not reserved by another sequence;
- otherwise a new reservation starts elsewhere (the sequence becomes two runs), and when no
  unreserved block is left, blocks reserved by others are taken (reservations are hints: a
  block is either allocated or free, and every free block counts in `num_free`).

Block tables stay correct whatever the placement; contiguity only makes attention cheaper.
"""

from __future__ import annotations

import re

from engines.sequence import Sequence

_ALLOCATED, _FREE, _RESERVED = 0, 1, 2
_FREE_RUN = re.compile(rb"\x01+")


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._state = bytearray([_FREE]) * num_blocks
        self._owner: dict[int, int] = {}  # reserved block -> seq_id
        self._reservations: dict[int, list[int]] = {}  # seq_id -> its reserved (not yet taken) blocks
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / self.num_blocks

    def needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get so that `num_tokens` tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def _expected_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the sequence will hold at its longest, as far as its request says."""
        total = seq.prompt_len + (seq.params.max_tokens if seq.params.max_tokens is not None
                                  else (self.max_model_len or num_tokens))
        if self.max_model_len:
            total = min(total, self.max_model_len)
        return max(blocks_for(max(total, num_tokens), self.block_size), 1)

    def growth(self, seq: Sequence) -> int:
        """Blocks `seq` will still take before it ends, as far as its request says."""
        return max(0, self._expected_blocks(seq, seq.num_tokens) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.needed(seq, num_tokens)
        if n > self._num_free:
            raise RuntimeError(f"KV cache out of blocks: need {n}, {self._num_free} free")
        ids = seq.block_ids
        for _ in range(n):
            nxt = ids[-1] + 1 if ids else -1
            if not (0 <= nxt < self.num_blocks and self._takeable(nxt, seq.seq_id)):
                nxt = self._reserve(seq, self._expected_blocks(seq, num_tokens) - len(ids))
            self._take(nxt)
            ids.append(nxt)

    def free(self, seq: Sequence) -> None:
        for b in seq.block_ids:
            self._state[b] = _FREE
        self._num_free += len(seq.block_ids)
        seq.block_ids = []
        for b in self._reservations.pop(seq.seq_id, ()):
            if self._owner.get(b) == seq.seq_id:
                del self._owner[b]
                self._state[b] = _FREE

    # placement
    def _takeable(self, b: int, seq_id: int) -> bool:
        s = self._state[b]
        return s == _FREE or (s == _RESERVED and self._owner.get(b) == seq_id)

    def _take(self, b: int) -> None:
        if self._state[b] == _RESERVED:
            del self._owner[b]
        self._state[b] = _ALLOCATED
        self._num_free -= 1

    def _reserve(self, seq: Sequence, want: int) -> int:
        """Start a new run for `seq`: reserve up to `want` blocks and return the first."""
        want = max(want, 1)
        start = end = -1
        m = re.search(rb"\x01{%d,}" % want, self._state)  # first fit
        if m:
            start, end = m.start(), m.start() + want
        else:
            best = max(_FREE_RUN.finditer(self._state), key=lambda r: r.end() - r.start(), default=None)
            if best is not None:
                start, end = best.start(), best.end()
        if start < 0:  # only blocks reserved by others are left: take the lowest
            return self._state.index(_RESERVED)
        mine = self._reservations.setdefault(seq.seq_id, [])
        for b in range(start, end):
            self._state[b] = _RESERVED
            self._owner[b] = seq.seq_id
            mine.append(b)
        return start
