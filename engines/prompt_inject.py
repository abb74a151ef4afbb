"""Worker side of p-tuning: replace the virtual tokens' embedding rows during prefill.

Virtual ids (>= vocab size) sit at positions 0..N-1 of a task's sequences (engines/ptuning.py),
so only prefill chunks starting below N carry them; decode steps never do.
"""

from __future__ import annotations

import numpy as np
import torch


class SeqTables:
    """Worker side: the table snapshot of each live sequence of a task, by seq_id.

    Filled from SeqInit.prompt_table when a sequence first reaches the worker, dropped when it is
    released; a preempted sequence keeps its entry, so its recompute injects the same rows."""

    def __init__(self, vocab_size: int, device: torch.device, dtype: torch.dtype):
        self.vocab_size, self.device, self.dtype = vocab_size, device, dtype
        self.tables: dict[int, torch.Tensor] = {}

    def update(self, plan) -> None:
        for seq_id in plan.released_seq_ids:
            self.tables.pop(seq_id, None)
        for init in plan.new_seqs:
            table = getattr(init, "prompt_table", None)
            if table is not None:
                self.tables[init.seq_id] = torch.as_tensor(np.array(table), dtype=self.dtype, device=self.device)

    def needed(self, works) -> bool:
        """Whether any prefill chunk covers virtual positions (they are positions 0..N-1)."""
        tables = self.tables
        return bool(tables) and any(w.seq_id in tables and w.start_pos < tables[w.seq_id].shape[0] for w in works)

    def embed(self, wte, input_ids: torch.Tensor, works) -> torch.Tensor:
        """input_ids (1, n) of `works` in order -> embeddings (1, n, C) with virtual rows replaced.

        The lookup runs on ids with virtual ids set to 0, through the model's own (possibly
        vocabulary-parallel, all-reduced) embedding; the table rows then replace those rows, so
        under TP the table is never summed across ranks."""
        virt = input_ids >= self.vocab_size
        x = wte(input_ids.masked_fill(virt, 0))  # (1, n, C)
        offset = 0
        for w in works:
            n = len(w.token_ids)
            table = self.tables.get(w.seq_id)
            if table is not None and w.start_pos < table.shape[0]:
                k = min(n, table.shape[0] - w.start_pos)  # virtual tokens in this chunk: its first k
                x[0, offset:offset + k] = table[w.start_pos:w.start_pos + k].to(x.dtype)
            offset += n
        return x
