"""Prefill chunks that share a cached prefix attend to it together (CPU).

With prefix caching, 64 chats that share a 1,000-token system prompt each prefill only their own
question (40 tokens), but every question still attends to the 1,000 shared keys. One attention call
per sequence and layer (PagedAttention's per-chunk path: read the context, one masked SDPA call)
made 1,920 calls a burst on SmolLM2, each 40 queries x 1,040 keys: ~48 GFLOP/s on the Xeon of
BENCHMARKS.md, 4.1 s of the burst's prefill on 2 threads and the larger part of its time to first
token. Here the chunks whose block tables start with the same cached blocks form a group, and per
layer:

  - the shared part: every query of the group (all sequences, all query heads of a kv head) against
    the shared keys as two matrix products per kv head (scores, then the probabilities times the
    values), in fp32, in slices of rows that keep the scores within SCORE_BYTES; each row keeps its
    maximum, its sum of exponentials and its weighted values;
  - each sequence's own part: its keys after the shared prefix (cached or written this step), all the
    group's sequences padded to one length and masked causally, in one batched product;
  - the two merged exactly (the log-sum-exp of both parts), as the paged decode kernel's cascade does.

Scores and sums are fp32 whatever the cache dtype (a bf16 product is exact in fp32), the softmax is
the usual max-shifted one, and the result is rounded once to the step's dtype: the same attention as
the per-sequence path up to the order of fp32 sums (tests/test_paged_cascade.py compares them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engines.model.kv_runs import block_runs, read_runs

MIN_SHARED_BLOCKS = 2
"""Shared cached blocks that make a group worth its products (below it, the per-sequence path)."""
SCORE_BYTES = 8 << 20
"""Most bytes of fp32 scores of the shared part at a time (a slice of the group's query rows)."""


@dataclass
class CascadeGroup:
    """Prefill chunks whose contexts start with the same `shared_len` cached slots (`shared_runs`)."""

    shared_runs: list[tuple[int, int]]
    shared_len: int
    q_index: torch.Tensor
    """(G, Tq) the step's rows of each chunk's queries; padding repeats a chunk's first row."""
    k_index: torch.Tensor
    """(G, Lo) cache slots of each sequence's own keys (after the shared prefix); padding: its first."""
    mask: torch.Tensor
    """(G, Tq, Lo) own key j visible to query i (a padding query sees key 0 only)."""
    rows: torch.Tensor
    """The step's rows of the valid queries, in (chunk, query) order."""
    valid: torch.Tensor
    """(G * Tq,) which of the padded queries are real."""


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
    shared_len = shared * bs
    G, Tq = len(chunks), max(n for _, n, _, _ in chunks)
    Lo = max(start + n - shared_len for _, n, start, _ in chunks)
    q_index = torch.empty(G, Tq, dtype=torch.long)
    k_index = torch.empty(G, Lo, dtype=torch.long)
    mask = torch.zeros(G, Tq, Lo, dtype=torch.bool)
    valid = torch.zeros(G, Tq, dtype=torch.bool)
    for g, (row, n, start, table) in enumerate(chunks):
        q_index[g] = row
        q_index[g, :n] = torch.arange(row, row + n)
        valid[g, :n] = True
        tab = torch.tensor(table)
        pos = torch.arange(shared_len, start + n)  # this sequence's own keys
        slots = tab[pos // bs] * bs + pos % bs
        k_index[g] = slots[0]
        k_index[g, :len(pos)] = slots
        # query i (position start + i) sees own key j (position shared_len + j) when shared_len + j <= start + i
        mask[g, :n, :len(pos)] = (torch.arange(len(pos))[None, :] <= (start - shared_len + torch.arange(n))[:, None])
        mask[g, n:, 0] = True
    runs = block_runs(chunks[0][3], bs, shared_len)
    return CascadeGroup(runs, shared_len, q_index, k_index, mask, q_index.view(-1)[valid.view(-1)], valid.view(-1))


def attend(group: CascadeGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q (N, nh, hd) of the step (its keys already in the cache) -> (valid queries, nh, hd) in q's dtype, the
    attention of the group's rows (group.rows) over their whole contexts."""
    G, Tq = group.q_index.shape
    nh, hd = q.shape[1:]
    nkv = k_cache.shape[1]
    rep = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    f32 = torch.float32
    rows_q = q[group.q_index.view(-1)].view(G * Tq, nkv, rep, hd)
    qg = rows_q.to(f32)
    # the shared part: rows (kv head, token * rep + r) against the shared keys of that head
    k_sh, v_sh = read_runs(k_cache, group.shared_runs), read_runs(v_cache, group.shared_runs)  # (S, nkv, hd)
    if amx_scores(q.dtype):
        m_s, l_s, o_s = _shared_amx(rows_q.permute(1, 0, 2, 3).reshape(nkv, -1, hd), k_sh, v_sh, scale)
    else:
        m_s, l_s, o_s = _shared_fp32(qg.permute(1, 0, 2, 3).reshape(nkv, -1, hd), k_sh, v_sh, scale)
    # each sequence's own keys, causally
    ko = k_cache[group.k_index].to(f32)  # (G, Lo, nkv, hd)
    vo = v_cache[group.k_index].to(f32)
    Lo = ko.shape[1]
    qo = qg.view(G, Tq, nkv, rep, hd).permute(0, 2, 1, 3, 4).reshape(G, nkv, Tq * rep, hd)
    sc = torch.matmul(qo, ko.permute(0, 2, 3, 1)).mul_(scale)  # (G, nkv, Tq * rep, Lo)
    visible = group.mask[:, None, :, None, :].expand(G, nkv, Tq, rep, Lo).reshape(G, nkv, Tq * rep, Lo)
    sc.masked_fill_(~visible, float("-inf"))
    m_o = sc.amax(-1, keepdim=True)
    p = sc.sub_(m_o).exp_()
    l_o = p.sum(-1, keepdim=True)
    o_o = torch.matmul(p, vo.permute(0, 2, 1, 3))  # (G, nkv, Tq * rep, hd)
    # merged: the shared rows reordered to (G, nkv, Tq * rep)
    def own_order(t: torch.Tensor) -> torch.Tensor:
        return t.view(nkv, G, Tq * rep, t.shape[-1]).transpose(0, 1)

    m_s, l_s, o_s = own_order(m_s), own_order(l_s), own_order(o_s)
    m = torch.maximum(m_s, m_o)
    a_s, a_o = (m_s - m).exp_(), (m_o - m).exp_()
    y = (o_s * a_s + o_o * a_o) / (l_s * a_s + l_o * a_o)  # (G, nkv, Tq * rep, hd)
    y = y.view(G, nkv, Tq, rep, hd).permute(0, 2, 1, 3, 4).reshape(G * Tq, nh, hd)
    return y[group.valid].to(q.dtype)


@functools.cache
def amx_scores(dtype: torch.dtype) -> bool:
    """Whether the shared part runs on the panel kernel's AMX tiles (bf16 caches on a host with AMX)."""
    if dtype != torch.bfloat16:
        return False
    from engines.cpu import panel_kernel

    try:
        return panel_kernel.panel_variant("auto") == "amx"
    except RuntimeError:
        return False


def _shared_fp32(qh: torch.Tensor, k_sh: torch.Tensor, v_sh: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qh (nkv, R, hd) fp32 against the shared keys (S, nkv, hd): each row's max (nkv, R, 1), sum of exponentials
    (nkv, R, 1) and weighted values (nkv, R, hd), two fp32 matrix products a slice of rows."""
    nkv, R, hd = qh.shape
    ks = k_sh.to(torch.float32).permute(1, 2, 0)  # (nkv, hd, S)
    vs = v_sh.to(torch.float32).transpose(0, 1)  # (nkv, S, hd)
    S = ks.shape[2]
    m_s, l_s, o_s = torch.empty(nkv, R, 1), torch.empty(nkv, R, 1), torch.empty(nkv, R, hd)
    step = max(1, SCORE_BYTES // (4 * nkv * S))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        sc = torch.bmm(qh[:, r0:r1], ks).mul_(scale)  # (nkv, rows, S)
        m = sc.amax(-1, keepdim=True)
        p = sc.sub_(m).exp_()
        m_s[:, r0:r1], l_s[:, r0:r1] = m, p.sum(-1, keepdim=True)
        torch.bmm(p, vs, out=o_s[:, r0:r1])
    return m_s, l_s, o_s


def _shared_amx(qh: torch.Tensor, k_sh: torch.Tensor, v_sh: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_shared_fp32 for bf16 rows qh (nkv, R, hd) on AMX tiles (engines/cpu/panel_kernel panel_linear_f32): the
    scores are the exact bf16 products summed in fp32 (as the fp32 path), the probabilities rounded to bf16 for
    the product with the values (as torch's bf16 SDPA does), sums fp32. The shared keys of a kv head are the
    "weight" of S outputs; its values, zero-padded to a multiple of 32 keys, that of hd outputs; each row's softmax
    one pass in C++ (softmax_rows, csrc/fused_decode.cpp)."""
    from engines.cpu import panel_kernel as pk

    mod = pk.load()[0]
    nkv, R, hd = qh.shape
    S = k_sh.shape[0]
    Sp = -(-S // 32) * 32
    m_s, l_s, o_s = torch.empty(nkv, R, 1), torch.empty(nkv, R, 1), torch.empty(nkv, R, hd)
    step = max(16, SCORE_BYTES // (4 * S) // 16 * 16)
    for h in range(nkv):
        k_panels = pk.pack_panels(k_sh[:, h])  # (S, hd): S outputs
        v_pad = torch.zeros(hd, Sp, dtype=v_sh.dtype)
        v_pad[:, :S] = v_sh[:, h].t()
        v_panels = pk.pack_panels(v_pad)  # hd outputs of Sp inputs
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            sc = pk.panel_linear_f32(qh[h, r0:r1], k_panels, S)  # (rows, S) fp32
            pb = torch.empty(r1 - r0, Sp, dtype=torch.bfloat16)
            m_s[h, r0:r1], l_s[h, r0:r1] = mod.softmax_rows(sc, scale, pb)
            o_s[h, r0:r1] = pk.panel_linear_f32(pb, v_panels, hd)
    return m_s, l_s, o_s
