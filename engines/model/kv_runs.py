"""A sequence's cache slots as runs of consecutive slots, and reading a context by its runs (paged attention and
the prefill cascade both read contexts this way)."""

from __future__ import annotations

import torch


def block_runs(block_ids: list[int], block_size: int, num_tokens: int) -> list[tuple[int, int]]:
    """The first `num_tokens` cache slots of a block table as (first slot, length) runs of
    consecutive slots: one run when the blocks are contiguous."""
    runs: list[tuple[int, int]] = []
    nb = -(-num_tokens // block_size)
    i = 0
    while i < nb:
        j = i
        while j + 1 < nb and block_ids[j + 1] == block_ids[j] + 1:
            j += 1
        runs.append((block_ids[i] * block_size, min((j + 1) * block_size, num_tokens) - i * block_size))
        i = j + 1
    return runs


def read_runs(cache: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """(L, nkv, hd) keys or values of one context: a view of the cache when it is one run."""
    if len(runs) == 1:
        start, length = runs[0]
        return cache[start:start + length]
    return torch.cat([cache[start:start + length] for start, length in runs])
