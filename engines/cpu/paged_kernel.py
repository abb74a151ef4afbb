"""A CPU paged-attention kernel for decode: one C++ op per layer for every decode sequence.

Decode attention reads each sequence's keys and values once (the step is memory-bound: a context of
L keys is 2 x L x nkv x hd elements for ~4 x L x nh x hd FLOPs). In torch ops that is either one
small SDPA call per sequence from a Python loop (single-threaded, ~0.16 ms a call at ~270 keys
on the 2-core EPYC of BENCHMARKS.md) or a gather of every context into a padded batch, which
copies the contexts once more than it reads them and measured 15-30x slower than the loop. This
kernel walks the block table in C++: one task per sequence (or part of its heads) over torch's intra-op
thread pool (so the engine's adaptive thread count applies), keys and values read in place from
the cache, scores, softmax and the weighted sum of values in fp32 whatever the cache dtype
(bf16 / fp16 are widened on load, as the eager path's fp32 scratch does). A task reads each
slot's key and value rows of its heads once, front to back (one sequential stream: a task per
(sequence, head) read 128-256-byte pieces 1.5-3 KB apart and streamed 3-8 GB/s once the contexts
outgrew the last-level cache); query heads that share a kv head (GQA) share its reads; the block
table is walked block by block (no division per key); the softmax's exponentials are computed 16
lanes at a time. For head sizes 16, 32, 64 and 128 (csrc attend_tiles) each key and value row of a kv head is
loaded once for up to 16 / (hd / 16) of the query heads that share it (fp16 keys and values widened to fp32 into a
buffer first, bf16 values in registers), whose queries score 16 keys as 16 lane-wise partial sums reduced by one
shuffle tree (not a horizontal sum a key) and whose value sums stay in registers across a block, the next block's
rows requested as this one's are read:
64 sequences x 220 keys, SmolLM2's shapes, one thread of the Xeon of BENCHMARKS.md, 2.58 -> 1.17 ms a layer
in bf16, 2.20 -> 1.18 ms in fp32 (x 500 keys: 3.1 -> 2.6 ms both, ~19 GB/s of cache read in fp32). A build for
AVX2 without AVX-512 runs the same walk with 8-lane intrinsics (csrc attend_avx2: GCC kept the 16-lane arrays on the
stack there; 64 x 200 keys on 2 threads of a Zen 3 EPYC, fp32 4.4 -> 1.7 ms a layer, bf16 3.8 -> 1.0). Other
head sizes take the per-key loop.

Shared prefixes (cascade decode): rows of a step whose block tables begin with the same >= 2 block
ids (prefix caching hands every chat of one system prompt the same blocks) form a group; the
shared slots' keys and values of each kv head are widened to fp32 once per group, and the group's
queries of that kv head (in pieces of <= 16 rows, one task each) meet them in two matrix products
(scores, then exponentials times values), each query keeping a partial (max, sum of exponentials,
unnormalised sum of values). Each row then attends its own suffix and merges the partial exactly (the
online-softmax merge), so a row's result equals its per-row attention up to float rounding whatever
else is in the batch (tests/test_paged_cascade.py). 64 rows x ~1,100 keys (SmolLM2 shapes, bf16, the
Xeon of BENCHMARKS.md): 1.8 ms a layer on 2 threads against 7.6 with per-key loops; a decode step of
those rows on one thread 153 -> 117 ms once the pieces stopped widening the shared part each.

It is built once per machine (engines/cpu/cpp_ext.py: gcc, -O3 -march=native, keyed by the CPU's model
and flags, so a cache shared between machines never loads a binary built for another CPU). `load()`
returns None with the reason when no compiler is present or the build fails; the engine then
uses the per-sequence loop and says why (EngineConfig.decode_attention).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the module with this kernel, why) or (None, why it is unavailable): the engine's one C++ module
    (engines/cpu/kernels.py), built on first use, then loaded from torch's extension cache."""
    from engines.cpu import kernels

    return kernels.load()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q (S, nh, hd), caches (slots, nkv, hd), table (S, max_blocks) int64, lens (S) int64 -> (S, nh, hd)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    return mod.paged_decode(q, k_cache, v_cache, table, lens, block_size)
