"""Prefill chunks that share a cached prefix attend to it together (CPU).

With prefix caching, 64 chats that share a 1,000-token system prompt each prefill only their own
question (40 tokens), but every question still attends to the 1,000 shared keys. One attention call
per sequence and layer (PagedAttention's per-chunk path: read the context, one masked SDPA call)
made 1,920 calls a burst on SmolLM2, each 40 queries x 1,040 keys: ~48 GFLOP/s on the Xeon of
BENCHMARKS.md, 4.1 s of the burst's prefill on 2 threads and the larger part of its time to first
token. Here the chunks whose block tables start with the same cached blocks form a group, and each
layer runs the group through one C++ op (cascade_prefill, engines/cpu/csrc/paged_decode.cpp): every
query row of a chunk is a decode row of the paged kernel's cascade whose context ends at its own
position, so

  - the shared part: the shared keys and values of each kv head are gathered once, and every query of
    the group (all chunks' rows, all query heads of a kv head) meets them as two matrix products a task of
    rows (the scores, then the probabilities times the values: for a bf16 cache AMX tiles or vdpbf16ps row
    blocks where the host has them, else fp32 products; bf16_prefill), each row keeping its maximum, sum of
    exponentials and weighted values;
  - each row's own slots after the prefix (its chunk's cached and new keys up to its position): the
    decode kernel's loop, merged exactly with the row's shared partial (the log-sum-exp of both parts).

Scores and sums are fp32 whatever the cache dtype, the softmax is the usual max-shifted one (on the bf16
products' paths the probabilities are rounded to bf16 for the product with the values, as torch's bf16 SDPA
does), and the result is rounded once to the step's dtype: the same attention as the per-sequence path up to
the order of fp32 sums (tests/test_paged_cascade.py compares them).

Every other prefill chunk of a step (fresh prompts, continuations outside a group) goes through attend_causal:
one C++ op a layer (causal_prefill), a task a chunk and kv head that gathers the chunk's context once and runs
each piece of PIECE_ROWS queries as the same two products over the piece's context, each query's softmax masked
to its own slots (on an AVX2 host without AVX-512: blocks of 6 tokens of a query head instead, causal_variant).
Per-sequence SDPA took one call (a fork and join of the threads) and a strided copy of its
output per chunk and layer: on a SmolLM2 step of 14 fresh prompts (1,900 rows) 8.0 ms a layer in bf16, 2.7 ms
here on AMX tiles (fp32: 7.3 against 5.6 ms).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_SHARED_BLOCKS = 2
"""Shared cached blocks that make a group worth its products (below it, the per-sequence path)."""


@dataclass
class CascadeGroup:
    """Prefill chunks whose block tables start with the same `shared_len` cached slots (whole blocks)."""

    shared_len: int
    block_size: int
    tables: torch.Tensor
    """(G, max blocks) int64: each chunk's block table, padded with block 0."""
    chunks: torch.Tensor
    """(G, 3) int64: each chunk's first row in the step, query count and start position."""
    rows: torch.Tensor
    """The step's rows of the chunks' queries, in (chunk, query) order: the rows of attend's result."""


def plan_groups(chunks: list[tuple[int, int, int, list[int]]], block_size: int
                ) -> tuple[list[CascadeGroup], set[int]]:
    """Groups of the chunks (first row, length, start position, block table) of a step that continue a
    cached context; returns them and the indices of the chunks they take (the rest keep their own path).
    A group shares the longest common run of block ids from the start of its tables that lies wholly
    before every member's first query (at least MIN_SHARED_BLOCKS blocks, two members or more)."""
    by_head: dict[tuple[int, ...], list[int]] = {}
    for i, (_, _, start, table) in enumerate(chunks):
        if start >= MIN_SHARED_BLOCKS * block_size:
            by_head.setdefault(tuple(table[:MIN_SHARED_BLOCKS]), []).append(i)
    groups, taken = [], set()
    for members in by_head.values():
        if len(members) < 2:
            continue
        tables = [chunks[i][3] for i in members]
        n = min(chunks[i][2] for i in members) // block_size  # blocks wholly before every first query
        shared = 0
        while shared < n and all(t[shared] == tables[0][shared] for t in tables):
            shared += 1
        if shared < MIN_SHARED_BLOCKS:
            continue
        groups.append(_group([chunks[i] for i in members], shared, block_size))
        taken.update(members)
    return groups, taken


def _group(chunks: list[tuple[int, int, int, list[int]]], shared: int, bs: int) -> CascadeGroup:
    mb = max(len(t) for _, _, _, t in chunks)
    tables = torch.tensor([t + [0] * (mb - len(t)) for _, _, _, t in chunks], dtype=torch.long)
    spec = torch.tensor([(row, n, start) for row, n, start, _ in chunks], dtype=torch.long)
    rows = torch.cat([torch.arange(row, row + n) for row, n, _, _ in chunks])
    return CascadeGroup(shared * bs, bs, tables, spec, rows)


def attend(group: CascadeGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q (N, nh, hd) of the step (its keys already in the cache) -> (len(group.rows), nh, hd) in q's dtype, the
    attention of the group's rows over their whole contexts."""
    from engines.cpu import kernels

    variant = bf16_prefill(q.dtype, q.shape[2], k_cache.dtype)
    return kernels.load()[0].cascade_prefill(q, k_cache, v_cache, group.tables, group.chunks, group.shared_len,
                                             group.block_size, variant)


PIECE_ROWS = 32
"""Query rows of a chunk that attend_causal's variants 0, 1, 3 and 4 run as one pair of products over the slots up to the piece's last
query (each query's softmax masked to its own; on a SmolLM2 step 32 beat 16 and 64 on AMX tiles)."""


def attend_causal(tables: torch.Tensor, chunks: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Causal attention of prefill chunks (tables (G, blocks), chunks (G, 3): first row, queries, start; their keys
    already in the cache) into their rows of out (N, nh, hd): per piece of PIECE_ROWS queries, the scores over the
    piece's context and the values as two products (AMX tiles for bf16 where the host has them), masked per query."""
    from engines.cpu import kernels

    variant = causal_variant(q.dtype, q.shape[2], k_cache.dtype)
    kernels.load()[0].causal_prefill(q, k_cache, v_cache, tables, chunks, block_size, variant, PIECE_ROWS, out)


def bf16_prefill(dtype: torch.dtype, hd: int, cache_dtype: torch.dtype) -> int:
    """The variant the products of cascade_prefill and causal_prefill run on, for bf16 queries and cache and a head
    size that is a multiple of 32: 3 (AMX tiles) on a host with AMX, 1 (the panel kernel's several-row blocks of
    vdpbf16ps) on one with AVX512-BF16; else, and for other dtypes, 0 (fp32 products: the keys and values widened,
    at::mm). FORCE_VARIANT, when set, replaces the host's answer (tests).

    Why 1 on AVX512-BF16: the fp32 products (MKL's sgemm on pieces of 32 queries x 3 heads) were ~7 % of the perf
    samples of SmolLM2's bf16 prefill (2,048-row steps of 200-token prompts, 2-core EPYC Zen 4); on the bf16 row
    blocks, both ways switched in one process: 64 prompts of 200 tokens 1,532 -> 1,606 prompt tok/s (median of 4),
    of 600 tokens 1,399 -> 1,513 (of 2). Without AVX512-BF16 the row blocks widen each pair to fp32 (no faster than sgemm):
    0 stays there."""
    if dtype != torch.bfloat16 or cache_dtype != torch.bfloat16 or hd % 32:
        return 0
    return _host_bf16() if FORCE_VARIANT is None else FORCE_VARIANT


def causal_variant(dtype: torch.dtype, hd: int, cache_dtype: torch.dtype) -> int:
    """The variant attend_causal runs on: bf16_prefill's where it has one for the host (AMX tiles, vdpbf16ps), else
    2 (csrc/paged_causal.cpp: blocks of 6 tokens of a query head through the panel kernel's AVX2 row blocks, fp32
    arithmetic on any dtype, the key panels up to each block's last token only) on any host with AVX2 and FMA (AVX-512
    hosts included), for a head size that is a multiple of 16; else 0. FORCE_VARIANT 2 forces 2 for any dtype.

    Why 2 there: at::mm on pieces of 32 queries x 3 heads ran SmolLM2's 2,485-row step at ~35 GFLOP/s of causal
    work a layer (call overhead, the masked half of each piece, its 16-lane exponentials' sums on the stack in an
    AVX2 build); the row blocks ~75 (2-core Zen 3, the same minutes: 15.5 -> 7.3 ms a layer fp32, 19 -> 10.6 bf16).
    The products' overhead is the same with an AVX-512 MKL: on a 2-core Zen 4 (AVX-512, AVX512-BF16), fp32 prefill of
    64 prompts of 16-256 tokens (5 steps, 150 layer calls) spent 757 ms in causal_prefill on 0 and 403 ms on 2."""
    v = bf16_prefill(dtype, hd, cache_dtype)
    if FORCE_VARIANT is not None:
        return 2 if FORCE_VARIANT == 2 else v
    return v or (2 if hd % 16 == 0 and _host_avx2() else 0)


FORCE_VARIANT: int | None = None
"""Tests: the variant every eligible chunk or group runs on (1: the bf16 row blocks, portable arithmetic where the
build lacks AVX512-BF16; 4: AMX's arithmetic in scalar C++, on any host; 0: the fp32 products; 2, causal chunks only:
the AVX2 row blocks), whatever the host."""


@functools.cache
def _host_avx2() -> bool:
    from engines.core.hardware import read_cpu_flags

    flags = read_cpu_flags() or frozenset()
    return "avx2" in flags and "fma" in flags


@functools.cache
def _host_bf16() -> int:
    from engines.cpu import panel_kernel

    try:
        if panel_kernel.panel_variant("auto") == "amx":
            return 3
        return 1 if panel_kernel.fp8_variant("auto", torch.bfloat16) == "avx512bf16" else 0
    except (RuntimeError, ValueError):
        return 0
