"""One shard's step: its stage's layers on its TP slice, its KV blocks, and (on one rank) the sampler.

Every rank of every stage runs the same plan. A step's sequences are cut into micro-batches;
a stage runs micro-batch m as soon as its input is there (token ids on the first stage,
activations received from the previous stage otherwise) and sends its output on without
waiting, so stages overlap. The last stage turns the sampled rows into vocabulary-sharded
logits; TP rank 0 of that stage samples, after either an argmax combined across shards (a
greedy batch: two numbers per row move) or a gather of the full logits (anything else), and
is the only rank that returns a StepResult.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engines.attention import KVCache, PagedAttention
from engines.config import EngineConfig, ModelConfig, resolved_dtype
from engines.grammar import Grammars, tokenizer_bytes
from engines.kv_sizing import shard_kv_budget
from engines.parallel.comm import Comm
from engines.parallel.layout import ParallelLayout, local_kv_heads
from engines.parallel.pp import StageModel, split_microbatches
from engines.plan import SeqResult, StepPlan, StepResult
from engines.prompt_inject import SeqTables
from engines.sampler import Sampler
from engines.sampling_params import SamplingParams
from engines.worker import DTYPES


def shard_num_blocks(cfg: ModelConfig, engine: EngineConfig, layout: ParallelLayout) -> int:
    """KV blocks of every shard (the scheduler's pool). kv_cache_bytes is each shard's budget,
    like a per-device memory budget, so the pool grows with the number of shards; the stage with
    the most layers sets the count."""
    if engine.num_kv_blocks:
        return engine.num_kv_blocks
    itemsize = 4 if resolved_dtype(engine) == "float32" else 2
    layers = max(e - s for s, e in layout.stages)
    heads = local_kv_heads(cfg, layout.tp, 0)[1]
    per_block = 2 * layers * engine.block_size * heads * cfg.hd * itemsize
    budget = engine.kv_cache_bytes or shard_kv_budget(cfg, engine, torch.device(engine.device))
    return max(1, budget // per_block)


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that needs the full vocabulary row (logprobs, penalties, suppression)."""
    return (p.greedy and not p.has_penalties and p.logprobs is None and p.min_tokens == 0
            and p.structured is None)


class ShardRunner:
    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, layout: ParallelLayout, rank: int,
                 comm: Comm, stage: StageModel | None = None):
        from engines.parallel.sharded_loading import load_shard

        self.engine_cfg, self.layout, self.rank, self.comm = engine_cfg, layout, rank, comm
        self.device = torch.device(engine_cfg.device)
        self.dtype = DTYPES[resolved_dtype(engine_cfg)]
        self.tp_rank, self.pp_rank = layout.coords(rank)
        start, end = layout.stages[self.pp_rank]
        if stage is None:
            cfg = ModelConfig.from_dir(model_dir)
            stage = load_shard(model_dir, cfg, start, end, comm, self.dtype, self.device, engine_cfg.weight_dtype)
        from engines.fp8 import apply_fp8  # FP8 block Linears: W8A8 or dequantized, chosen once here

        self.fp8 = apply_fp8(stage, engine_cfg.weight_dtype, self.device, self.dtype)
        self.stage, self.cfg = stage, stage.cfg
        self.first, self.last = self.pp_rank == 0, self.pp_rank == layout.pp - 1
        self.num_blocks = shard_num_blocks(self.cfg, engine_cfg, layout)
        self.cache = KVCache(end - start, self.num_blocks, engine_cfg.block_size,
                             local_kv_heads(self.cfg, layout.tp, self.tp_rank)[1], self.cfg.hd, self.dtype, self.device)
        self.samples = self.last and self.tp_rank == 0
        self.sampler = Sampler(self.cfg.vocab_size, engine_cfg.seed, self.device, grammars=Grammars(
            tokenizer_bytes(model_dir), self.cfg.vocab_size)) if self.samples else None
        # p-tuning: input tasks' embedding rows on the first stage, every-layer tasks' keys/values on
        # every rank (its layers and KV heads)
        self.prompt_tables = SeqTables(self.cfg.vocab_size, self.device, self.dtype, self.cfg.n_layer,
                                       self.cfg.kv_heads, self.cfg.hd, layers=(start, end),
                                       local_kv=local_kv_heads(self.cfg, layout.tp, self.tp_rank))
        self.params: dict[int, SamplingParams] = {}
        """Sampling options of the live sequences, kept by every last-stage rank so that all of
        them take the same (combined-argmax or gathered) path."""
        self.spans: list[tuple[float, float, float]] = []
        """(start, end, busy seconds) of each step, for the bubble measurement."""

    @property
    def model_config(self) -> ModelConfig:
        return self.cfg

    @torch.inference_mode()
    def execute(self, plan: StepPlan, want_logits: bool = False
                ) -> tuple[StepResult | None, dict[int, torch.Tensor] | None]:
        """Run this shard's part of the step. The sampling rank returns (result, logits of each
        sampled sequence if want_logits); every other rank returns (None, None)."""
        t0 = time.perf_counter()
        if self.last:
            for seq_id in plan.released_seq_ids:
                self.params.pop(seq_id, None)
                if self.sampler is not None:
                    self.sampler.release(seq_id)
            for init in plan.new_seqs:
                self.params[init.seq_id] = init.params
                if self.sampler is not None:
                    self.sampler.add(init)
        self.prompt_tables.update(plan)
        result = StepResult(step=plan.step) if self.samples else None
        if plan.empty:
            return result, None
        works = [*plan.decode, *plan.prefill]
        n_decode = len(plan.decode)
        busy = 0.0
        sample_ids: list[int] = []
        sample_logits: list[torch.Tensor] = []  # (rows, Vp) per micro-batch
        lp_logits: list[tuple[int, list[int], torch.Tensor]] = []
        for m, group in enumerate(split_microbatches(works, self.layout.microbatches(self.engine_cfg,
                                                                                    plan.num_tokens))):
            ws = [works[i] for i in group]
            ids: list[int] = []
            pos: list[int] = []
            for w in ws:
                ids.extend(w.token_ids)
                pos.extend(range(w.start_pos, w.start_pos + len(w.token_ids)))
            positions = torch.tensor(pos, device=self.device)[None]  # (1, n)
            backend = PagedAttention(self.cache, [works[i] for i in group if i < n_decode],
                                     [works[i] for i in group if i >= n_decode], self.device)
            embeds = None
            virtual = self.prompt_tables.needed(ws)
            if virtual:
                backend.kv_prefix = self.prompt_tables.kv_rows(ws)
            if self.first:
                x = torch.tensor(ids, device=self.device)[None]  # (1, n) token ids
                if virtual:  # every TP rank of the stage: the lookup all-reduces
                    embeds = self.prompt_tables.embed(self.stage.wte, x, ws)
            else:
                x = self.comm.recv_prev((1, len(ids), self.cfg.n_embd), self.dtype, tag=m)  # (1, n, C)
            tb = time.perf_counter()
            hidden = self.stage(x, positions, backend, inputs_embeds=embeds)  # (1, n, C)
            if not self.last:
                self.comm.send_next(hidden, tag=m)
            else:
                self._head(ws, hidden[0], sample_ids, sample_logits, lp_logits)
            busy += time.perf_counter() - tb
        self.comm.flush()
        logits_out = None
        if self.last:
            tb = time.perf_counter()
            logits_out = self._sample(result, sample_ids, sample_logits, lp_logits, want_logits)
            busy += time.perf_counter() - tb
        self.spans.append((t0, time.perf_counter(), busy))
        return result, logits_out

    def _head(self, ws, hidden: torch.Tensor, sample_ids: list[int], sample_logits: list[torch.Tensor],
              lp_logits: list[tuple[int, list[int], torch.Tensor]]) -> None:
        """Local logits of the rows to sample and the prompt-logprob rows of one micro-batch."""
        rows = []
        offset = 0
        for w in ws:
            if w.sample:
                rows.append(offset + len(w.token_ids) - 1)
                sample_ids.append(w.seq_id)
            if w.prompt_lp_targets:
                first = offset + w.prompt_lp_from - w.start_pos
                lp_logits.append((w.seq_id, w.prompt_lp_targets,
                                  self.stage.logits(hidden[first:first + len(w.prompt_lp_targets)])))
            offset += len(w.token_ids)
        if rows:
            h = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
            sample_logits.append(self.stage.logits(h))  # (rows, Vp)

    def _gather_full(self, local: torch.Tensor) -> torch.Tensor | None:
        """(rows, Vp) vocabulary shards -> (rows, V) full logits on TP rank 0, None elsewhere."""
        parts = self.comm.gather(local, "tp_logits")
        if parts is None:
            return None
        return torch.cat(parts, -1)[:, :self.cfg.vocab_size] if len(parts) > 1 else local[:, :self.cfg.vocab_size]

    def _sample(self, result: StepResult | None, sample_ids: list[int], sample_logits: list[torch.Tensor],
                lp_logits: list[tuple[int, list[int], torch.Tensor]], want_logits: bool) -> dict[int, torch.Tensor] | None:
        logits_out = None
        if sample_ids:
            local = torch.cat(sample_logits, 0) if len(sample_logits) > 1 else sample_logits[0]  # (S, Vp)
            if not want_logits and all(plain_greedy(self.params[s]) for s in sample_ids):
                tokens = self._combined_argmax(local)
                if self.samples:
                    for seq_id, tok in zip(sample_ids, tokens):
                        self.sampler.states[seq_id].num_output += 1
                        result.seqs[seq_id] = SeqResult(token_id=tok)
            else:
                full = self._gather_full(local)
                if self.samples:
                    for seq_id, (tok, lp) in zip(sample_ids, self.sampler.sample(sample_ids, full)):
                        result.seqs[seq_id] = SeqResult(token_id=tok, logprob=lp)
                    if want_logits:
                        logits_out = {s: full[i].clone() for i, s in enumerate(sample_ids)}
        for seq_id, targets, local in lp_logits:
            full = self._gather_full(local)
            if self.samples:
                lp = torch.log_softmax(full, dim=-1)
                top_n = self.params[seq_id].prompt_logprobs or 0
                result.seqs.setdefault(seq_id, SeqResult()).prompt_logprobs = [
                    Sampler.logprob_entry(lp[j], tok, top_n) for j, tok in enumerate(targets)]
        return logits_out

    def _combined_argmax(self, local: torch.Tensor) -> list[int]:
        """Greedy tokens from vocabulary shards: each rank's best (value, id); the highest value
        wins, ties going to the lowest id (as a single argmax over the full row would)."""
        vals, idx = local.max(dim=-1)  # (S,)
        start = self.tp_rank * local.shape[-1]
        packed = torch.stack([vals.double(), (idx + start).double()], -1)  # (S, 2)
        parts = self.comm.gather(packed, "tp_logits")
        if parts is None:
            return []
        allp = torch.stack(parts, 1)  # (S, tp, 2)
        best = allp[:, :, 0].argmax(dim=1)  # first (lowest-rank) maximum
        return allp[torch.arange(allp.shape[0]), best, 1].long().tolist()
