"""Worker side of p-tuning: the virtual tokens' embedding rows, or every layer's keys/values, in prefill.

Virtual ids (>= vocab size) sit at positions 0..N-1 of a task's sequences (engines/transforms/ptuning.py),
so only prefill chunks starting below N carry them; decode steps never do.

An input task replaces the embedding rows of those positions (first pipeline stage). A task of
every layer leaves the embeddings alone (the rows' hidden states are never read: every layer's
keys/values at those positions are the table's) and hands the attention backend, for each layer
of this shard, the rows to write into the keys/values before they reach the cache
(PagedAttention.kv_prefix).
"""

from __future__ import annotations

import numpy as np
import torch


class SeqTables:
    """Worker side: the table snapshot of each live sequence of a task, by seq_id.

    Filled from SeqInit.prompt_table when a sequence first reaches the worker, dropped when it is
    released; a preempted sequence keeps its entry, so its recompute injects the same rows.

    layers (first, end) and kv_heads (first, count) pick this shard's part of a task of every
    layer (a pipeline stage's layers, a tensor-parallel rank's KV heads); None: all of them."""

    def __init__(self, vocab_size: int, device: torch.device, dtype: torch.dtype, n_layer: int = 0,
                 kv_heads: int = 0, head_dim: int = 0, layers: tuple[int, int] | None = None,
                 local_kv: tuple[int, int] | None = None):
        self.vocab_size, self.device, self.dtype = vocab_size, device, dtype
        self.n_layer, self.kv_heads, self.head_dim = n_layer, kv_heads, head_dim
        self.layers = layers or (0, n_layer)
        self.local_kv = local_kv or (0, kv_heads)
        self.tables: dict[int, torch.Tensor] = {}
        """Input tasks: (N, C) embedding rows."""
        self.kv: dict[int, torch.Tensor] = {}
        """Tasks of every layer: (local layers, N, 2, local KV heads, head_dim) keys/values."""

    def update(self, plan) -> None:
        for seq_id in plan.released_seq_ids:
            self.tables.pop(seq_id, None)
            self.kv.pop(seq_id, None)
        for init in plan.new_seqs:
            table = getattr(init, "prompt_table", None)
            if table is None:
                continue
            t = torch.as_tensor(np.array(table), dtype=self.dtype, device=self.device)
            if getattr(init, "prompt_every_layer", False):
                # PEFT's row layout: layer 0's key, layer 0's value, layer 1's key, ... (kv_heads x head_dim each)
                t = t.view(t.shape[0], self.n_layer, 2, self.kv_heads, self.head_dim)
                (l0, l1), (h0, hn) = self.layers, self.local_kv
                self.kv[init.seq_id] = t[:, l0:l1, :, h0:h0 + hn].permute(1, 0, 2, 3, 4).contiguous()
            else:
                self.tables[init.seq_id] = t

    def _covers(self, w) -> int:
        """Virtual positions of work w's chunk (its first k tokens), 0 when none."""
        t = self.tables.get(w.seq_id)
        n = t.shape[0] if t is not None else (self.kv[w.seq_id].shape[1] if w.seq_id in self.kv else 0)
        return max(0, min(len(w.token_ids), n - w.start_pos))

    def needed(self, works) -> bool:
        """Whether any prefill chunk covers virtual positions (they are positions 0..N-1)."""
        return bool(self.tables or self.kv) and any(self._covers(w) for w in works)

    def embed(self, wte, input_ids: torch.Tensor, works) -> torch.Tensor:
        """input_ids (1, n) of `works` in order -> embeddings (1, n, C) with virtual rows replaced.

        The lookup runs on ids with virtual ids set to 0, through the model's own (possibly
        vocabulary-parallel, all-reduced) embedding; an input task's rows then replace those rows,
        so under TP the table is never summed across ranks. A task of every layer keeps token 0's
        embedding there (never read)."""
        virt = input_ids >= self.vocab_size
        x = wte(input_ids.masked_fill(virt, 0))  # (1, n, C)
        offset = 0
        for w in works:
            n = len(w.token_ids)
            table = self.tables.get(w.seq_id)
            if table is not None and (k := self._covers(w)):  # virtual tokens in this chunk: its first k
                x[0, offset:offset + k] = table[w.start_pos:w.start_pos + k].to(x.dtype)
            offset += n
        return x

    def kv_rows(self, works) -> list[tuple[int, int, torch.Tensor]]:
        """For the attention backend: (first row of the step, rows, this shard's (layers, rows, 2,
        heads, hd) keys/values) of every chunk of a task of every layer that covers virtual positions."""
        if not self.kv:
            return []
        out, offset = [], 0
        for w in works:
            if w.seq_id in self.kv and (k := self._covers(w)):
                out.append((offset, k, self.kv[w.seq_id][:, w.start_pos:w.start_pos + k]))
            offset += len(w.token_ids)
        return out
