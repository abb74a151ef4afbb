"""The last stage's end of a step: logits of the rows to sample, and sampling on one rank.

Every rank of the last pipeline stage turns its micro-batches' sampled rows (and prompt-logprob rows)
into logits: the full vocabulary on one device, its vocabulary shard on a tensor-parallel rank. TP
rank 0 samples, after either an argmax combined across shards (a greedy TP batch: two numbers per row
move, two more for a row with min_tokens) or a gather of the full logits (anything else; on one device the
gather is the identity), and is the only rank that fills a StepResult.
"""

from __future__ import annotations

import torch

from engines.core.plan import SeqResult, SeqWork, StepPlan, StepResult
from engines.core.sampling_params import SamplingParams
from engines.parallel.comm import Comm
from engines.runner.sampler import Sampler, min_tokens_ids


class StepHead:
    """Logits and sampling of a last-stage rank; `sampler` only on the sampling rank (TP rank 0)."""

    def __init__(self, model: torch.nn.Module, comm: Comm, sampler: Sampler | None, vocab_size: int, tp_rank: int,
                 screen=None):
        self.model, self.comm, self.sampler = model, comm, sampler
        self.vocab_size, self.tp_rank = vocab_size, tp_rank
        self.screen = screen if comm.tp_size == 1 and sampler is not None else None
        """engines/cpu/greedy_head.GreedyScreen (an fp32 CPU head): the tokens of plain greedy rows without their full
        logits; None: every sampled row's logits."""
        self._screen_rows: list[tuple[list[int], torch.Tensor]] = []  # (seq ids, hidden rows) of screened micro-batches
        self.params: dict[int, SamplingParams] = {}
        """Sampling options of the live sequences, kept by every last-stage rank so that all of
        them take the same (combined-argmax or gathered) path."""
        self._ruled_out: dict[int, list[int]] = {}
        """Sequences with min_tokens: the ids they may not draw until they have that many outputs (every rank)."""
        self._sample_ids: list[int] = []
        self._sample_logits: list[torch.Tensor] = []  # (rows, Vp) per micro-batch
        self._lp_logits: list[tuple[int, list[int], torch.Tensor]] = []

    def update(self, plan: StepPlan) -> None:
        """Forget released sequences, learn new ones (before the step's rows arrive)."""
        for seq_id in plan.released_seq_ids:
            self.params.pop(seq_id, None)
            self._ruled_out.pop(seq_id, None)
            if self.sampler is not None:
                self.sampler.release(seq_id)
        for init in plan.new_seqs:
            self.params[init.seq_id] = init.params
            if init.params.min_tokens:
                self._ruled_out[init.seq_id] = min_tokens_ids(init, self.vocab_size)
            if self.sampler is not None:
                self.sampler.add(init)

    def add_rows(self, ws: list[SeqWork], hidden: torch.Tensor) -> None:
        """Local logits of one micro-batch's rows to sample and its prompt-logprob rows; hidden (n, C)."""
        rows, ids = [], []
        offset = 0
        for w in ws:
            if w.sample:
                rows.append(offset + len(w.token_ids) - 1)
                ids.append(w.seq_id)
            if w.prompt_lp_targets:
                first = offset + w.prompt_lp_from - w.start_pos
                self._lp_logits.append((w.seq_id, w.prompt_lp_targets,
                                        self.model.logits(hidden[first:first + len(w.prompt_lp_targets)])))
            offset += len(w.token_ids)
        if rows:
            h = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
            # greedy_argmax: rows with min_tokens too (their ids ruled out in the screen; `loadtest --ignore-eos` sends
            # min_tokens = max_tokens, and SmolLM2's fp32 64-stream mix ran 303 tok/s served with them on the full
            # head, 315 screened: 2-core EPYC Zen 4, alternating runs)
            if (self.screen is not None and self.screen.applies(len(rows))
                    and all(self.params[s].greedy_argmax for s in ids)):
                self._screen_rows.append((ids, h))  # logits later only if the step wants them (sample)
                return
            self._sample_ids.extend(ids)
            self._sample_logits.append(self.model.logits(h))  # (rows, Vp)

    def sample(self, result: StepResult | None, want_logits: bool) -> dict[int, torch.Tensor] | None:
        """Sample the rows added this step into `result` (the sampling rank's); returns the logits of
        each sampled sequence when want_logits (sampling rank only)."""
        sample_ids, sample_logits, lp_logits = self._sample_ids, self._sample_logits, self._lp_logits
        self._sample_ids, self._sample_logits, self._lp_logits = [], [], []
        screened, self._screen_rows = self._screen_rows, []
        for ids, h in screened:  # plain greedy micro-batches: their tokens, or their logits where wanted or unsure
            tokens = None if want_logits else self.screen.tokens(h, self._suppressed(ids))
            if tokens is None:
                sample_ids.extend(ids)
                sample_logits.append(self.model.logits(h))
                continue
            self._record_greedy(result, ids, tokens.tolist())
        logits_out = None
        if sample_ids:
            local = torch.cat(sample_logits, 0) if len(sample_logits) > 1 else sample_logits[0]  # (S, Vp)
            if (self.comm.tp_size > 1 and not want_logits
                    and all(self.params[s].greedy_argmax for s in sample_ids)):
                tokens = self._combined_argmax(local, sample_ids)
                if self.sampler is not None:
                    self._record_greedy(result, sample_ids, tokens)
            else:
                full = self._gather_full(local)
                if self.sampler is not None:
                    for seq_id, (tok, lp) in zip(sample_ids, self.sampler.sample(sample_ids, full)):
                        result.seqs[seq_id] = SeqResult(token_id=tok, logprob=lp)
                    if want_logits:
                        logits_out = {s: full[i].clone() for i, s in enumerate(sample_ids)}
        for seq_id, targets, local in lp_logits:
            full = self._gather_full(local)
            if self.sampler is not None:
                lp = torch.log_softmax(full, dim=-1)
                top_n = self.params[seq_id].prompt_logprobs or 0
                result.seqs.setdefault(seq_id, SeqResult()).prompt_logprobs = [
                    Sampler.logprob_entry(lp[j], tok, top_n) for j, tok in enumerate(targets)]
        return logits_out

    def _suppressed(self, seq_ids: list[int]) -> tuple[list[int], list[int]] | None:
        """(rows, token ids) that the rows of seq_ids may not draw now (min_tokens), or None."""
        rows, cols = [], []
        for i, s in enumerate(seq_ids):
            if s in self._ruled_out:
                banned = self.sampler.suppressed_ids(self.sampler.states[s])
                rows.extend([i] * len(banned))
                cols.extend(banned)
        return (rows, cols) if rows else None

    def _record_greedy(self, result: StepResult, seq_ids: list[int], tokens: list[int]) -> None:
        """Greedy tokens chosen without the sampler (a combined TP argmax, the screen): counted and reported as its own."""
        for seq_id, tok in zip(seq_ids, tokens):
            self.sampler.states[seq_id].num_output += 1
            result.seqs[seq_id] = SeqResult(token_id=tok)

    def _gather_full(self, local: torch.Tensor) -> torch.Tensor | None:
        """(rows, Vp) vocabulary shards -> (rows, V) full logits on TP rank 0, None elsewhere."""
        if self.comm.tp_size == 1:  # one device, or a pipeline stage of one rank: nothing moves
            return local if local.shape[-1] == self.vocab_size else local[:, :self.vocab_size]
        parts = self.comm.gather(local, "tp_logits")
        if parts is None:
            return None
        return torch.cat(parts, -1)[:, :self.vocab_size]

    def _combined_argmax(self, local: torch.Tensor, seq_ids: list[int]) -> list[int]:
        """Greedy tokens from vocabulary shards: each rank's best (value, id); the highest value wins, ties going to
        the lowest id (as a single argmax over the full row would). A row with min_tokens sends its best outside its
        ruled-out ids as well (every rank knows them), and the sampling rank takes that one while the row is short
        of min_tokens: its tokens are the masked row's argmax with two more numbers a row, where it gathered the
        full logits before (a load test holding outputs at max_tokens sends min_tokens = max_tokens). The last
        rank's zero-padded tail (ids >= vocab_size) is no token."""
        start = self.tp_rank * local.shape[-1]
        own = local[:, :max(0, min(local.shape[-1], self.vocab_size - start))]
        if own.shape[-1]:
            vals, idx = own.max(dim=-1)  # (S,)
        else:  # a shard of padding only: nothing to offer
            vals = torch.full((own.shape[0],), float("-inf"), device=own.device)
            idx = torch.zeros(own.shape[0], dtype=torch.long, device=own.device)
        held = [i for i, s in enumerate(seq_ids) if s in self._ruled_out]
        if held:
            # a row's best outside its ruled-out ids is its best (the first maximum is allowed, so it is the first
            # allowed one too) unless that best is ruled out: only such rows are copied, masked and searched again
            hv, hi = vals[held].clone(), idx[held].clone()
            for j, (i, best) in enumerate(zip(held, hi.tolist())):
                ids = self._ruled_out[seq_ids[i]]
                if best + start in ids:
                    row = own[i].clone()
                    row[[t - start for t in ids if start <= t < start + own.shape[-1]]] = float("-inf")
                    hv[j], hi[j] = row.max(dim=-1)
            vals, idx = torch.cat([vals, hv]), torch.cat([idx, hi])
        packed = torch.stack([vals.double(), (idx + start).double()], -1)  # (S + held, 2)
        parts = self.comm.gather(packed, "tp_logits")
        if parts is None:
            return []
        allp = torch.stack(parts, 1)  # (S + held, tp, 2)
        best = allp[:, :, 0].argmax(dim=1)  # first (lowest-rank) maximum
        tokens = allp[torch.arange(allp.shape[0]), best, 1].long().tolist()
        out = tokens[:len(seq_ids)]
        for j, i in enumerate(held, len(seq_ids)):
            if self.sampler.suppressed_ids(self.sampler.states[seq_ids[i]]):
                out[i] = tokens[j]
        return out
