"""Paged attention in plain torch: keys and values live in fixed-size blocks of one flat cache.

The step's tokens arrive as one flattened row: first the decode tokens (one per sequence), then
the prefill chunks. Per layer, the backend writes the new keys/values into their slots, then
  - decode on CPU: attends sequence by sequence, reading each one's context in place as a slice
    of the cache (the block manager keeps a sequence's blocks contiguous; a sequence split over
    several runs of blocks concatenates just its own runs). On 2 CPU cores this is ~10x faster
    than gathering every context into one padded batch, and a sequence's result cannot depend on
    the others in the batch;
  - decode on CPU where the C++ kernel of engines.cpu.paged_kernel builds (the default): one op per
    layer walks every sequence's block table on the intra-op threads (measured 1.05-5.4x faster
    than the loop above at 1-64 sequences, 1 and 2 threads, fp32 and bf16: BENCHMARKS.md, issue 12);
  - decode elsewhere (CUDA): gathers every decode sequence's context (S, L, nkv, hd) with one
    index computed once per step, masks the padding, and runs one batched attention (one kernel
    launch per layer instead of one per sequence);
  - prefill: a fresh prompt attends to its own keys causally; a later chunk of a long prompt
    reads its cached context (by runs, as above) and uses an offset causal mask; on CPU, chunks
    that continue the same cached prefix (prefix caching: chats under one system prompt) attend to
    it together, one C++ op a layer for the whole group (engines/model/prefill_cascade.py). On CUDA the
    step's fresh prompts (two or more) run as one padded batch: one attention call per layer
    with a causal and key-padding mask, instead of one call and ~5 launches per prompt (64
    prompts of 60 tokens: ~1,500 launches a layer fewer); on CPU one prompt at a time (no
    padding work, and a prompt's result cannot depend on the others).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engines.core.plan import SeqWork
from engines.cpu import module_ops
from engines.cpu.cpu_threads import single_threaded
from engines.cpu.host_memory import HUGE_PAGE, huge_page_zeros, populate
from engines.cpu.paged_kernel import paged_decode
from engines.model import prefill_cascade
from engines.model.kv_runs import block_runs, read_runs

BATCHED_PREFILL_MAX_MASK = 1 << 26
"""Most elements (prompts x longest prompt^2) of the batched fresh-prefill mask; above it, and for
very uneven prompt lengths, the prompts run one at a time."""
CAUSAL_PREFILL = True
"""CPU with the C++ module: prefill chunks through causal_prefill (one op a layer). Tests set it False to compare
the decode kernel with the per-sequence loop where only decode differs (bf16 prefill rounds differently there)."""


def long_tensor(values) -> torch.Tensor:
    """An int64 tensor of a list of ints (or of equal-length lists) through numpy: torch.tensor of a Python list
    takes ~0.3 us an element (a 2,048-token chunk's ids: 0.6 ms), numpy a tenth of that."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def padded_tables(tables: list[list[int]], width: int | None = None, fill: int = 0) -> torch.Tensor:
    """Block tables (G, width: the most blocks by default) int64, each padded with `fill` (a row assigned at a time:
    no per-element work)."""
    out = np.full((len(tables), max(map(len, tables)) if width is None else width), fill, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return torch.from_numpy(out)


def decode_slots(decode: list[SeqWork], block_size: int) -> list[int]:
    """The cache slot each decode row writes: its position's slot in its block table."""
    return [w.block_ids[w.start_pos // block_size] * block_size + w.start_pos % block_size for w in decode]


def decode_tables(decode: list[SeqWork]) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged decode kernel's block tables (S, most blocks) int64, zero-padded, and context lengths (S,)."""
    return padded_tables([w.block_ids for w in decode]), long_tensor([w.start_pos + 1 for w in decode])


@dataclass
class PrefillMeta:
    q_start: int
    q_len: int
    start_pos: int
    ctx_runs: list[tuple[int, int]] | None
    """Runs of cache slots of the whole context (start_pos + q_len); None for a fresh prompt."""


class KVCache:
    """Keys and values of all layers: (n_layer, 2, num_blocks * block_size, nkv, hd)."""

    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._prefault_at, self._prefaulted = 0, False  # prefault's progress: 2 MB pieces mapped; all done
        shape = (n_layer, 2, num_blocks * block_size, n_kv_head, head_dim)
        if torch.device(device).type == "cpu":
            # untouched zeros: pages are mapped as blocks are first written, so a cache sized from free
            # memory costs only what the running sequences use (2 MB at a time where the host gives
            # huge pages: decode attention streams every context each step, and with 4 KB pages a
            # page walk every 4 KB and the prefetchers' stop at each page cost 64 sequences x 158
            # positions of SmolLM2 (bf16, 2-core Xeon) 23.7-25.8 against 19.7-20.4 ms a step's 30
            # layers; elsewhere calloc'd numpy zeros, 4 KB at a time)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = huge_page_zeros(nbytes)
            if raw is None:
                raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
            self.data = raw.view(dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def prefault(self, max_bytes: int, upto_block: int) -> int:
        """Map up to `max_bytes` more of the CPU cache's pages of blocks [0, upto_block) ahead of their first writes
        (host_memory.populate), lowest blocks first (the order the block manager fills the pool in: first fit), all
        layers' keys and values alike. Returns n: blocks [0, n) are mapped now (the pool's size where nothing is
        left to map: all of it mapped, a device cache, or a host that cannot); the caller stops once n >=
        upto_block. The engine's idle loop calls it (engines/core/async_engine.py) and tells the block manager
        (BlockManager.mapped); the contents never change."""
        if self.data.device.type != "cpu" or self._prefaulted:
            return self.num_blocks
        slabs = self.data.shape[0] * self.data.shape[1]
        slab = self.nbytes // slabs  # one layer's keys (or values) of every slot
        per_block = slab // self.num_blocks
        limit = min(slab, upto_block * per_block)
        done = 0
        while True:
            off, i = divmod(self._prefault_at, slabs)  # the next 2 MB of slab i: off counts whole rounds
            off *= HUGE_PAGE
            if off >= slab:
                self._prefaulted = True
                return self.num_blocks
            if off >= limit or done >= max_bytes:
                return off // per_block  # whole rounds: every slab mapped that far
            n = min(HUGE_PAGE, slab - off)
            if not populate(self.data, i * slab + off, n):
                self._prefaulted = True
                return self.num_blocks
            self._prefault_at += 1
            done += n


class PagedAttention:
    """The attention backend the model calls for one engine step (see engines.model.transformer).

    `batched_decode` picks the decode strategy: None chooses by device (per sequence, in place,
    on CPU; one padded gather elsewhere); tests force either to compare them. `decode_kernel`
    (CPU) runs decode through engines.cpu.paged_kernel instead: one op per layer over the block table
    (the caller checked that the kernel loads, see ModelRunner)."""

    def __init__(self, cache: KVCache, decode: list[SeqWork], prefill: list[SeqWork], device: torch.device,
                 batched_decode: bool | None = None, decode_kernel: bool = False,
                 batched_prefill: bool | None = None):
        self.cache = cache
        self._scratch: torch.Tensor | None = None  # fp32 keys/values of one context (bf16 / fp16 decode)
        bs = cache.block_size
        slots: list[torch.Tensor] = []
        self.n_decode = len(decode)
        self.dec_runs: list[list[tuple[int, int]]] = []
        self.dec_index: torch.Tensor | None = None
        self.dec_mask: torch.Tensor | None = None
        self.dec_table: torch.Tensor | None = None  # (S, max_blocks) block ids, for the kernel
        self.dec_lens: torch.Tensor | None = None  # (S,) context lengths
        if batched_decode is None:
            batched_decode = torch.device(device).type != "cpu"
        if decode:
            ctx = [w.start_pos + 1 for w in decode]
            slots.append(long_tensor(decode_slots(decode, bs)))
            if decode_kernel and torch.device(device).type == "cpu":  # the kernel reads the tables: no runs
                self.dec_table, self.dec_lens = decode_tables(decode)
            else:  # the runs of each context: per sequence in place (_decode), unless batched below
                self.dec_runs = [block_runs(w.block_ids, bs, c) for w, c in zip(decode, ctx)]
            if self.dec_table is None and batched_decode and not (len(decode) == 1 and len(self.dec_runs[0]) == 1):
                table = padded_tables([w.block_ids for w in decode])  # (S, max_blocks)
                lmax = max(ctx)
                index = (table[:, :, None] * bs + torch.arange(bs)).view(len(decode), -1)[:, :lmax]  # (S, L)
                self.dec_index = index.to(device)
                # (S, 1, 1, L): key j of sequence s is visible when j < ctx[s]
                self.dec_mask = (torch.arange(lmax)[None, :] < long_tensor(ctx)[:, None]).view(
                    len(decode), 1, 1, lmax).to(device)
        self.prefill: list[PrefillMeta] = []
        q_start = self.n_decode
        chunk_tables: dict[int, list[int]] = {}  # a chunk's first row -> its block table
        for w in prefill:
            table = long_tensor(w.block_ids)
            end = w.start_pos + len(w.token_ids)
            pos = torch.arange(w.start_pos, end)
            slots.append(table[pos // bs] * bs + pos % bs)
            self.prefill.append(PrefillMeta(q_start, len(w.token_ids), w.start_pos,
                                            block_runs(w.block_ids, bs, end) if w.start_pos > 0 else None))
            chunk_tables[q_start] = w.block_ids
            q_start += len(w.token_ids)
        self.slot_mapping = torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long)
        if batched_prefill is None:
            batched_prefill = torch.device(device).type != "cpu"
        self.pf: tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """Batched fresh prompts: (P, T, gather index (P*T,), mask (P, 1, T, T), valid flat
        positions, their rows of the step)."""
        fresh = [p for p in self.prefill if p.ctx_runs is None]
        if batched_prefill and len(fresh) >= 2:
            P, T = len(fresh), max(p.q_len for p in fresh)
            if P * T * T <= BATCHED_PREFILL_MAX_MASK and 2 * sum(p.q_len for p in fresh) >= P * T:
                index = torch.zeros(P, T, dtype=torch.long)  # padding gathers row 0 (masked out as a key)
                valid = torch.zeros(P, T, dtype=torch.bool)
                for i, p in enumerate(fresh):
                    index[i, :p.q_len] = torch.arange(p.q_start, p.q_start + p.q_len)
                    valid[i, :p.q_len] = True
                # query i of a prompt sees its keys j <= i; a padded query row still sees key 0 (no NaN)
                mask = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]  # (P, T, T)
                sel = valid.view(-1).nonzero().view(-1)
                self.pf = (P, T, index.view(-1).to(device), mask[:, None].to(device), sel.to(device),
                           index.view(-1)[sel].to(device))
                self.prefill = [p for p in self.prefill if p.ctx_runs is not None]
        self.cascade: list[prefill_cascade.CascadeGroup] = []
        """CPU: chunks that continue the same cached prefix, attending to it together (prefill_cascade)."""
        if torch.device(device).type == "cpu" and decode_kernel:  # the C++ module is loaded (ModelRunner)
            cont = [p for p in self.prefill if p.ctx_runs is not None]
            self.cascade, taken = prefill_cascade.plan_groups(
                [(p.q_start, p.q_len, p.start_pos, chunk_tables[p.q_start]) for p in cont], bs)
            taken_rows = {cont[i].q_start for i in taken}
            self.prefill = [p for p in self.prefill if p.q_start not in taken_rows]
        self.causal: tuple[torch.Tensor, torch.Tensor] | None = None
        """CPU: every other prefill chunk, fresh or continuing, through one C++ op a layer (causal_prefill in
        csrc/paged_decode.cpp): (block tables (G, max blocks), chunks (G, 3): first row, queries, start)."""
        if torch.device(device).type == "cpu" and decode_kernel and self.prefill and CAUSAL_PREFILL:
            self.causal = (padded_tables([chunk_tables[p.q_start] for p in self.prefill]),
                           long_tensor([(p.q_start, p.q_len, p.start_pos) for p in self.prefill]))
            self.prefill = []
        self.kv_prefix: list[tuple[int, int, torch.Tensor]] = []
        """P-tuning of every layer: (first row, rows, (layers, rows, 2, nkv, hd)) keys/values that
        replace those rows' own in every layer (engines/transforms/prompt_inject.py SeqTables.kv_rows)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, nh, hd), k/v (N, nkv, hd) for this step's N tokens -> (N, nh, hd)."""
        k_cache, v_cache = self.cache.data[layer]  # (slots, nkv, hd) each
        # before the cache write, so prefill attention and later steps both see them; in place: this
        # step's k/v (views of the qkv output, or rotary's fresh tensors) are read nowhere else
        if self.kv_prefix:
            for row, n, kv in self.kv_prefix:
                k[row:row + n] = kv[layer, :, 0].to(k.dtype)
                v[row:row + n] = kv[layer, :, 1].to(v.dtype)
        module_ops.write_slots(k_cache, self.slot_mapping, k)
        module_ops.write_slots(v_cache, self.slot_mapping, v)
        gqa = q.shape[1] != k.shape[1]
        if not self.prefill and self.pf is None and not self.cascade and self.causal is None:
            return self._decode(q, k_cache, v_cache, gqa)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.n_decode:
            out[:self.n_decode] = self._decode(q[:self.n_decode], k_cache, v_cache, gqa)
        if self.pf is not None:  # the fresh prompts, one padded batch
            P, T, index, mask, sel, rows = self.pf
            qs = q[index].view(P, T, *q.shape[1:]).transpose(1, 2)  # (P, nh, T, hd)
            ks = k[index].view(P, T, *k.shape[1:]).transpose(1, 2)  # (P, nkv, T, hd)
            vs = v[index].view(P, T, *v.shape[1:]).transpose(1, 2)
            y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)  # (P, nh, T, hd)
            out[rows] = y.transpose(1, 2).reshape(P * T, *q.shape[1:])[sel]
        for group in self.cascade:
            out[group.rows] = prefill_cascade.attend(group, q, k_cache, v_cache)
        if self.causal is not None:
            prefill_cascade.attend_causal(*self.causal, q, k_cache, v_cache, self.cache.block_size, out)
        for p in self.prefill:
            qs = q[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]  # (1, nh, T, hd)
            if p.ctx_runs is None:
                ks = k[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]  # (1, nkv, T, hd)
                vs = v[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
                y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                ks = read_runs(k_cache, p.ctx_runs).transpose(0, 1)[None]  # (1, nkv, L, hd)
                vs = read_runs(v_cache, p.ctx_runs).transpose(0, 1)[None]
                L = p.start_pos + p.q_len
                # query i sits at position start_pos + i and sees keys 0..start_pos + i
                mask = torch.arange(L, device=q.device)[None, :] <= (
                    p.start_pos + torch.arange(p.q_len, device=q.device))[:, None]  # (T, L)
                y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
            out[p.q_start:p.q_start + p.q_len] = y[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gqa: bool) -> torch.Tensor:
        S = q.shape[0]
        if self.dec_table is not None:  # one C++ op over the intra-op threads
            return paged_decode(q, k_cache, v_cache, self.dec_table, self.dec_lens, self.cache.block_size)
        qd = q[:, :, None, :]  # (S, nh, 1, hd)
        if self.dec_index is not None:
            ks = k_cache[self.dec_index].transpose(1, 2)  # (S, nkv, L, hd)
            vs = v_cache[self.dec_index].transpose(1, 2)
            y = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=self.dec_mask, enable_gqa=gqa)
            return y.view(S, q.shape[1], q.shape[2])
        out = torch.empty_like(q)
        upcast = q.dtype != torch.float32 and q.device.type == "cpu"
        if upcast:
            # CPU SDPA in bf16 with one query row ran 2-4x slower than in fp32 on the same context
            # (AVX512-BF16 EPYC, 1 thread: 416 against 106 us for 256 keys, 12 heads): the context is
            # copied into fp32 scratch (allocated once per step: a fresh ~1.5 MB tensor per call
            # hit mmap and page faults, 1.5 ms) and attended there, as the compiled step does
            L = max(sum(n for _, n in runs) for runs in self.dec_runs)  # longest context
            if self._scratch is None or self._scratch.shape[1] < L:
                self._scratch = torch.empty(2, L, *k_cache.shape[1:], dtype=torch.float32)  # (2, L, nkv, hd)
            qd = qd.float()
        # one small op per sequence (~1 MFLOP): no fork/join of the thread team for each
        with single_threaded():
            for i, runs in enumerate(self.dec_runs):
                ks, vs = read_runs(k_cache, runs), read_runs(v_cache, runs)  # (L, nkv, hd), views for one run
                if upcast:
                    ks = self._scratch[0, :ks.shape[0]].copy_(ks)
                    vs = self._scratch[1, :vs.shape[0]].copy_(vs)
                y = F.scaled_dot_product_attention(qd[i:i + 1], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                                   enable_gqa=gqa)  # (1, nh, 1, hd)
                out[i] = y[0, :, 0]
        return out
