"""Static-shape decode: the decode-only steps of the engine, padded to fixed batch buckets.

A decode step of S sequences runs as the smallest bucket B >= S from persistent input buffers
filled in place (token ids, positions, slot mapping, block table (B, max_blocks_per_seq),
sequence lengths): every tensor the step reads has a fixed shape and address, so on CUDA the
step is captured once per bucket as a CUDA graph and replayed, and nothing in the step reads a
value back to the host. Padded rows (S..B) write their keys and values into a reserved null block
(the cache's last block, never handed to the scheduler) and attend to it alone; their outputs are
dropped. Batches above the largest bucket, steps with prefill chunks, and CPU by default run the
eager path (engines.model.attention.PagedAttention).

A shard runs the same step over its own layers (engines/runner/model_runner.py): a later pipeline stage's input
buffer holds the hidden states it received (B, C) instead of token ids, and a tensor-parallel shard's
step all-reduces inside (captured into its graphs on CUDA: NCCL collectives are capturable; every rank
captures the same graphs, the stop at the capture budget agreed over the group, and the collectives a
replay runs are counted into the communicator's counters as the eager step counts them).

With `compiled` (CPU, EngineConfig.compile_decode), the step is engines.runner.compiled.decode_step
compiled by inductor: it reads the cache only, over the block table sliced to the longest row's
blocks, and its new keys and values are written after the graph (see engines/runner/compiled.py).

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
import time

import torch
import torch.nn.functional as F

from engines.core.plan import SeqWork
from engines.model.attention import KVCache, long_tensor, padded_tables
from engines.runner.compiled import MIN_CONTEXT_BLOCKS, CompiledDecode, write_new_kv

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CAPTURE_BUDGET_S = 30.0
"""Default seconds of graph capture at load (EngineConfig.cuda_graph_capture_s)."""


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
        B, nh, hd = q.shape
        nkv = k.shape[1]
        k_cache, v_cache = self.cache.data[layer]  # (slots, nkv, hd)
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        ks = k_cache[self.index].transpose(1, 2)  # (B, nkv, L, hd)
        vs = v_cache[self.index].transpose(1, 2)
        # grouped-query attention without repeating K/V: the g = nh / nkv query heads that share a
        # kv head are that head's g "query rows" (decode sees the whole context, so no causal mask)
        qg = q.view(B, nkv, nh // nkv, hd)  # (B, nkv, g, hd)
        y = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=self.mask)  # (B, nkv, g, hd)
        return y.reshape(B, nh, hd)


class DecodeRunner:
    """Runs decode-only steps padded to buckets; one CUDA graph per bucket when `cuda_graphs`, the
    inductor-compiled step (engines.runner.compiled) when `compiled`."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, null_block: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, cuda_graphs: bool = False, compiled: bool = False,
                 comm=None):
        """model: a GPT, or a shard's pipeline stage (engines.parallel.pp.StageModel); comm: the shard's
        communicator (engines.parallel.comm.Comm; None on one device)."""
        self.model, self.cache, self.comm = model, cache, comm
        self.first = getattr(model, "first", True)  # a later pipeline stage starts from hidden states
        self.null_block, self.max_blocks = null_block, max_blocks_per_seq
        self.buckets = tuple(sorted(buckets))
        dev = cache.data.device
        self.cuda_graphs = cuda_graphs and dev.type == "cuda"
        bmax, bs = self.buckets[-1], cache.block_size
        self.bs = bs
        # persistent inputs, (bmax, ...): a bucket B uses the first B rows (views keep addresses); ids are
        # token ids (bmax,) on a first stage, the received hidden states (bmax, C) on a later one
        self.ids = (torch.zeros(bmax, dtype=torch.long, device=dev) if self.first else
                    torch.zeros(bmax, model.cfg.n_embd, dtype=cache.data.dtype, device=dev))
        self.pos = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.slots = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.table = torch.full((bmax, max_blocks_per_seq), null_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(bmax, dtype=torch.long, device=dev)
        self._offsets = torch.arange(bs, device=dev)
        self._keys = torch.arange(max_blocks_per_seq * bs, device=dev)
        self.context_buckets = context_buckets(max_blocks_per_seq)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """(batch bucket, context bucket) -> the captured step and its output buffer."""
        self._graph_comm: dict[tuple[int, int], tuple[dict[str, int], dict[str, int]]] = {}
        """(batch, context) -> the (calls, bytes) by purpose of the collectives its graph replays."""
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.compiled = CompiledDecode(model, bs) if compiled else None
        # the compiled step never reads a 1-column table (dynamo would specialise it)
        self.ctx_choices = tuple(c for c in self.context_buckets if c >= MIN_CONTEXT_BLOCKS or not compiled) or (
            max_blocks_per_seq,)
        self.captured_at_load = False
        self.capture_s = 0.0

    def warm_up(self) -> float:
        """Compile (or load from inductor's cache) the compiled step's two graphs now, not in the first
        request's step: the smallest bucket and the next (B = 1, and every B >= 2); returns seconds.
        On CUDA the captures at load compile (capture_at_load)."""
        if self.compiled is None or self.cuda_graphs:
            return 0.0
        self.compiled.warm_up(self.cache.data, self.ids, self.pos, self.table, self.buckets[:2])
        return self.compiled.compile_s

    def bucket_for(self, decode: list[SeqWork]) -> int | None:
        if any(len(w.block_ids) > self.max_blocks for w in decode):
            return None
        return pick_bucket(self.buckets, len(decode))

    def _fill(self, decode: list[SeqWork], B: int, ncols: int, x: torch.Tensor | None = None) -> None:
        """Host -> persistent buffers, in place: one copy per buffer, padded rows to the null block.
        Only the first `ncols` block-table columns are written (the step reads no others), so the
        host builds B x ncols ints a step, not B x max_blocks (524K at batch 64 and 128K context).
        x: a later stage's input hidden states (S, C); padded rows get zeros."""
        S, bs, null = len(decode), self.bs, self.null_block
        if self.first:
            ids = [w.token_ids[0] for w in decode] + [0] * (B - S)
            self.ids[:B].copy_(long_tensor(ids), non_blocking=True)
        else:
            self.ids[:S].copy_(x)
            self.ids[S:B].zero_()
        # through numpy (attention.long_tensor): torch.tensor of a Python list costs ~0.3 us an element, and the
        # table is B x ncols of them
        pos = long_tensor([w.start_pos for w in decode] + [0] * (B - S))
        table = padded_tables([w.block_ids[:ncols] for w in decode] + [[]] * (B - S), ncols, null)  # padding: null
        slots = table[torch.arange(B), pos // bs] * bs + pos % bs  # padded rows: the null block
        self.pos[:B].copy_(pos, non_blocking=True)
        self.slots[:B].copy_(slots, non_blocking=True)
        self.table[:B, :ncols].copy_(table, non_blocking=True)
        self.lens[:B].copy_(pos + 1, non_blocking=True)

    def context_bucket(self, decode: list[SeqWork]) -> int:
        """Block-table columns the step reads: the smallest context bucket holding its longest row."""
        return pick_bucket(self.ctx_choices, max(len(w.block_ids) for w in decode))

    def _key(self, decode: list[SeqWork], B: int) -> tuple[int, bool]:
        """(block-table columns the step reads, whether a captured graph runs it). With graphs captured
        at load, a (batch, context) pair not in the plan runs the nearest wider captured context."""
        longest = max(len(w.block_ids) for w in decode)
        if not self.cuda_graphs and self.compiled is not None:  # CPU compiled: the longest row's blocks
            return max(MIN_CONTEXT_BLOCKS, longest), False
        nblk = self.context_bucket(decode)
        if not self.cuda_graphs:
            return nblk, False
        if (B, nblk) in self.graphs or not self.captured_at_load:
            return nblk, True
        wider = [c for (b, c) in self.graphs if b == B and c >= nblk]
        return (min(wider), True) if wider else (nblk, False)

    @property
    def kind(self) -> str:
        """Which static step runs: "graph" (CUDA graphs), "compiled" (CPU inductor) or "static" (eager)."""
        return "graph" if self.cuda_graphs else "compiled" if self.compiled is not None else "static"

    def run(self, decode: list[SeqWork], x: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (S, C) of a decode-only step; the caller checked bucket_for() first. x: a later
        pipeline stage's input hidden states (S, C). On a graph the result is a view of the graph's
        output buffer, which the next replay overwrites."""
        B = self.bucket_for(decode)
        assert B is not None, "batch above the largest bucket: run the eager path"
        nblk, graphed = self._key(decode, B)
        self._fill(decode, B, nblk, x)
        if not graphed:
            return self._step(B, nblk)[:len(decode)]
        if (B, nblk) not in self.graphs:  # lazily, when not captured at load
            self.graphs[B, nblk] = self._capture(B, nblk)
        graph, out = self.graphs[B, nblk]
        graph.replay()
        if self.comm is not None and (B, nblk) in self._graph_comm:  # the collectives the replay ran
            calls, nbytes = self._graph_comm[B, nblk]
            for what, n in calls.items():
                self.comm.calls[what] += n
                self.comm.bytes[what] += nbytes.get(what, 0)
        return out[:len(decode)]

    def _step(self, B: int, nblk: int | None = None) -> torch.Tensor:
        """The padded step on buffers only (what a graph captures): hidden states (B, C). It reads
        the first nblk block-table columns of each row (all of them when None)."""
        nblk = nblk or self.max_blocks
        if self.compiled is not None:  # reads the cache only; the new keys/values are written after
            hidden, new_kv = self.compiled(self.cache.data, self.ids[:B], self.pos[:B], self.table[:B, :nblk])
            write_new_kv(self.cache.data, self.slots[:B], new_kv)
            return hidden
        index = (self.table[:B, :nblk, None] * self.bs + self._offsets).view(B, -1)  # (B, L) cache slots
        mask = (self._keys[None, :nblk * self.bs] < self.lens[:B, None]).view(B, 1, 1, -1)  # (B, 1, 1, L)
        backend = StaticDecodeBackend(self.cache, self.slots[:B], index, mask)
        return self.model(self.ids[None, :B], self.pos[None, :B], backend)[0]

    def capture_at_load(self, budget_s: float = CAPTURE_BUDGET_S, max_num_seqs: int | None = None) -> float:
        """Capture the planned (batch, context) graphs now, before any request, within budget_s
        (the first capture's time estimates the rest); later steps never capture. Returns seconds."""
        if not self.cuda_graphs:
            return 0.0
        t0 = time.perf_counter()
        top = pick_bucket(self.buckets, max_num_seqs or self.buckets[-1]) or self.buckets[-1]
        plan = capture_plan(tuple(b for b in self.buckets if b <= top), self.ctx_choices, est_s=0.0, budget_s=budget_s)
        for i, key in enumerate(plan):
            spent = time.perf_counter() - t0
            if self._agree_stop(bool(i and spent + spent / i > budget_s)):  # the next would pass the budget
                break
            self._capture_safe(key)
        self.captured_at_load = True
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def _agree_stop(self, stop: bool) -> bool:
        """Whether any rank of a tensor-parallel group stops capturing: their graphs hold the same
        collectives, so every rank must capture the same ones (each measures its own time)."""
        if self.comm is None or self.comm.tp_size == 1:
            return stop
        flag = torch.tensor([1.0 if stop else 0.0], device=self.ids.device)
        return bool(self.comm.all_reduce(flag, "capture").item() > 0)

    def _capture_safe(self, key: tuple[int, int]) -> None:
        B, nblk = key
        self.ids[:B].zero_()  # a valid step on the null block: rows of one position
        self.pos[:B].zero_()
        self.slots[:B].fill_(self.null_block * self.bs)
        self.table[:B, :nblk].fill_(self.null_block)
        self.lens[:B].fill_(1)
        self.graphs[key] = self._capture(B, nblk)

    def _capture(self, B: int, nblk: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (allocator, kernels, the compiled step's compile), then capture the
        bucket's step into the runner's shared pool (graphs never replay at once, and each keeps its
        output buffer alive)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(B, nblk)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        calls0, bytes0 = (dict(self.comm.calls), dict(self.comm.bytes)) if self.comm is not None else ({}, {})
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(B, nblk)
        if self.comm is not None:  # counted once while capturing; a replay adds them again (run)
            self._graph_comm[B, nblk] = ({k: v - calls0.get(k, 0) for k, v in self.comm.calls.items()},
                                         {k: v - bytes0.get(k, 0) for k, v in self.comm.bytes.items()})
        return graph, out


def capture_plan(batch_buckets: tuple[int, ...], ctx_buckets: tuple[int, ...], est_s: float,
                 budget_s: float) -> list[tuple[int, int]]:
    """(batch, context) graphs to capture at load, in order, within budget_s at est_s a capture
    (est_s 0: all, the caller stops at its budget). Every batch bucket's widest context first, so any
    step has a graph that holds it; then the narrower contexts, shortest first (short contexts are
    the common case and gain most from reading fewer columns)."""
    widest = ctx_buckets[-1]
    order = [(b, widest) for b in batch_buckets]
    order += [(b, c) for c in ctx_buckets[:-1] for b in batch_buckets]
    if est_s <= 0:
        return order
    return order[:max(0, int(budget_s // est_s))]
