"""Static-shape decode: the decode-only steps of the engine, padded to fixed batch buckets.

A decode step of S sequences runs as the smallest bucket B >= S from persistent input buffers
filled in place (token ids, positions, slot mapping, block table (B, max_blocks_per_seq),
sequence lengths): every tensor the step reads has a fixed shape and address, so on CUDA the
step is captured once per bucket as a CUDA graph and replayed, and nothing in the step reads a
value back to the host. Padded rows (S..B) write their keys and values into a reserved null block
(the cache's last block, never handed to the scheduler) and attend to it alone; their outputs are
dropped. Batches above the largest bucket, steps with prefill chunks, and CPU by default run the
eager path (engines.attention.PagedAttention).

With `compiled` (CPU, EngineConfig.compile_decode), the step is engines.compiled.decode_step
compiled by inductor: it reads the cache only, over the block table sliced to the longest row's
blocks, and its new keys and values are written after the graph (see engines/compiled.py).

Attention gathers each row's context through the first N columns of the block table into
(B, N x block_size, nkv, hd) and masks keys at or beyond the row's length. N is a context bucket,
the smallest power of two (or max_blocks_per_seq) that holds the step's longest row, so a step
reads what its rows hold, not max_model_len for every row; a graph is captured per (batch bucket,
context bucket) met, lazily, all in one shared memory pool (they never run at once). That is one
fused kernel per layer on a GPU; on CPU the eager path reads each context in place and is faster
(benchmarks/bench_peer_vllm.py), which is why the runner is off there unless asked for.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from engines.attention import KVCache
from engines.compiled import MIN_CONTEXT_BLOCKS, CompiledDecode, write_new_kv
from engines.plan import SeqWork

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def context_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths a decode step is padded to: powers of two below max_blocks, and max_blocks."""
    out, n = [], 1
    while n < max_blocks:
        out.append(n)
        n *= 2
    return (*out, max_blocks)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest bucket that holds n rows; None when n is above the largest (eager fallback)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class StaticDecodeBackend:
    """Attention for one padded decode step, reading only the runner's persistent buffers."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, index: torch.Tensor, mask: torch.Tensor):
        self.cache, self.slots, self.index, self.mask = cache, slots, index, mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, hd), k/v (B, nkv, hd) -> (B, nh, hd)."""
        k_cache, v_cache = self.cache.data[layer]  # (slots, nkv, hd)
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        ks = k_cache[self.index].transpose(1, 2)  # (B, nkv, L, hd)
        vs = v_cache[self.index].transpose(1, 2)
        y = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, attn_mask=self.mask,
                                           enable_gqa=q.shape[1] != k.shape[1])  # (B, nh, 1, hd)
        return y[:, :, 0, :]


class DecodeRunner:
    """Runs decode-only steps padded to buckets; one CUDA graph per bucket when `cuda_graphs`, the
    inductor-compiled step (engines.compiled) when `compiled`."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, null_block: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, cuda_graphs: bool = False, compiled: bool = False):
        self.model, self.cache = model, cache
        self.null_block, self.max_blocks = null_block, max_blocks_per_seq
        self.buckets = tuple(sorted(buckets))
        dev = cache.data.device
        self.cuda_graphs = cuda_graphs and dev.type == "cuda"
        bmax, bs = self.buckets[-1], cache.block_size
        self.bs = bs
        # persistent inputs, (bmax, ...): a bucket B uses the first B rows (views keep addresses)
        self.ids = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.slots = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.table = torch.full((bmax, max_blocks_per_seq), null_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(bmax, dtype=torch.long, device=dev)
        self._offsets = torch.arange(bs, device=dev)
        self._keys = torch.arange(max_blocks_per_seq * bs, device=dev)
        self.context_buckets = context_buckets(max_blocks_per_seq)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """(batch bucket, context bucket) -> the captured step and its output buffer."""
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.compiled = CompiledDecode(model, bs) if compiled and not self.cuda_graphs else None

    def warm_up(self) -> float:
        """Compile (or load from inductor's cache) the compiled step's two graphs now, not in the first
        request's step: the smallest bucket and the next (B = 1, and every B >= 2); returns seconds."""
        if self.compiled is None:
            return 0.0
        self.compiled.warm_up(self.cache.data, self.ids, self.pos, self.table, self.buckets[:2])
        return self.compiled.compile_s

    def bucket_for(self, decode: list[SeqWork]) -> int | None:
        if any(len(w.block_ids) > self.max_blocks for w in decode):
            return None
        return pick_bucket(self.buckets, len(decode))

    def _fill(self, decode: list[SeqWork], B: int) -> None:
        """Host -> persistent buffers, in place: one copy per buffer, padded rows to the null block."""
        S, mb, bs = len(decode), self.max_blocks, self.bs
        ids = [w.token_ids[0] for w in decode] + [0] * (B - S)
        pos = [w.start_pos for w in decode] + [0] * (B - S)
        table = [w.block_ids + [self.null_block] * (mb - len(w.block_ids)) for w in decode]
        table += [[self.null_block] * mb] * (B - S)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(table, pos)]
        self.ids[:B].copy_(torch.tensor(ids), non_blocking=True)
        self.pos[:B].copy_(torch.tensor(pos), non_blocking=True)
        self.slots[:B].copy_(torch.tensor(slots), non_blocking=True)
        self.table[:B].copy_(torch.tensor(table), non_blocking=True)
        self.lens[:B].copy_(torch.tensor(pos) + 1, non_blocking=True)

    def context_bucket(self, decode: list[SeqWork]) -> int:
        """Block-table columns the step reads: the smallest context bucket holding its longest row."""
        return pick_bucket(self.context_buckets, max(len(w.block_ids) for w in decode))

    def _step(self, B: int, nblk: int | None = None) -> torch.Tensor:
        """The padded step on buffers only (what a graph captures): hidden states (B, C). It reads
        the first nblk block-table columns of each row (all of them when None)."""
        nblk = nblk or self.max_blocks
        index = (self.table[:B, :nblk, None] * self.bs + self._offsets).view(B, -1)  # (B, L) cache slots
        mask = (self._keys[None, :nblk * self.bs] < self.lens[:B, None]).view(B, 1, 1, -1)  # (B, 1, 1, L)
        backend = StaticDecodeBackend(self.cache, self.slots[:B], index, mask)
        return self.model(self.ids[None, :B], self.pos[None, :B], backend)[0]

    def run(self, decode: list[SeqWork]) -> torch.Tensor:
        """Hidden states (S, C) of a decode-only step; the caller checked bucket_for() first."""
        B = self.bucket_for(decode)
        assert B is not None, "batch above the largest bucket: run the eager path"
        self._fill(decode, B)
        if self.compiled is not None:
            nblk = max(MIN_CONTEXT_BLOCKS, max(len(w.block_ids) for w in decode))  # longest row's blocks
            hidden, new_kv = self.compiled(self.cache.data, self.ids[:B], self.pos[:B], self.table[:B, :nblk])
            write_new_kv(self.cache.data, self.slots[:B], new_kv)
            return hidden[:len(decode)]
        nblk = self.context_bucket(decode)
        if not self.cuda_graphs:
            return self._step(B, nblk)[:len(decode)]
        if (B, nblk) not in self.graphs:
            self.graphs[B, nblk] = self._capture(B, nblk)
        graph, out = self.graphs[B, nblk]
        graph.replay()
        return out[:len(decode)]

    def _capture(self, B: int, nblk: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (allocator, kernels), then capture the bucket's step into the
        runner's shared pool (graphs never replay at once, and each keeps its output buffer alive)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(B, nblk)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(B, nblk)
        return graph, out
