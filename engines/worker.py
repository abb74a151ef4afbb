"""The model runner: owns the weights, the KV cache and the sampler state, and runs one step.

An executor drives one runner per shard; the in-process executor drives exactly one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engines.attention import KVCache, PagedAttention
from engines.checkpoint import load_model
from engines.compiled import CompileUnavailable, configure_cache, resolve_compile
from engines.config import EngineConfig, ModelConfig, max_model_len, num_kv_blocks, resolved_dtype
from engines.decode_runner import DecodeRunner
from engines.grammar import Grammars, tokenizer_bytes
from engines.kv_sizing import kv_cache_budget
from engines.plan import SeqResult, StepPlan, StepResult
from engines.prompt_inject import SeqTables
from engines.sampler import Sampler

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def without_dropout(model: torch.nn.Module) -> None:
    """Replace every nn.Dropout by nn.Identity in place: a no-op in eval mode either way, but each
    is ~3 us of calls, 25 a GPT-2 token (HF GPT-2 configs ask for 0.1); the engine never trains."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Dropout):
                setattr(parent, name, torch.nn.Identity())


class ModelRunner:
    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, model: torch.nn.Module | None = None):
        self.engine_cfg = engine_cfg
        self.device = torch.device(engine_cfg.device)
        self.dtype = DTYPES[resolved_dtype(engine_cfg)]  # an engine hands a resolved config; auto here too
        if model is None:
            model, cfg = load_model(model_dir, dtype=self.dtype, device=self.device)
            without_dropout(model)  # ours alone: a model handed in may still be trained by its owner
        else:
            cfg = model.cfg
        from engines.fp8 import apply_fp8  # FP8 block Linears: W8A8 or dequantized, chosen once here

        self.fp8 = apply_fp8(model, engine_cfg.weight_dtype, self.device, self.dtype)
        if engine_cfg.cpu_linear_autotune and self.device.type == "cpu":
            from engines.fast_linear import apply_fast_linear

            # steps may run on one thread (engines.cpu_threads.AdaptiveThreads): time that count too
            apply_fast_linear(model, single_thread_too=engine_cfg.adaptive_threads and engine_cfg.worker_threads == 0)
        self.model, self.cfg = model, cfg
        budget = None if engine_cfg.num_kv_blocks else kv_cache_budget(cfg, engine_cfg, self.device)
        self.num_blocks = num_kv_blocks(cfg, engine_cfg, budget)
        self.compile_decode, why = resolve_compile(engine_cfg.compile_decode, self.device)
        if engine_cfg.compile_decode != "off":
            log.info(why)
        static = engine_cfg.static_decode == "on" or (engine_cfg.static_decode == "auto" and (
            self.device.type == "cuda" or self.compile_decode))
        if static and self.num_blocks > 1:
            self.num_blocks -= 1  # the last block is the decode runner's null block (padded rows)
        self.cache = KVCache(cfg.n_layer, self.num_blocks + static, engine_cfg.block_size, cfg.kv_heads, cfg.hd,
                             self.dtype, self.device)
        self.decode_runner = DecodeRunner(
            model, self.cache, null_block=self.num_blocks,
            max_blocks_per_seq=-(-max_model_len(cfg, engine_cfg) // engine_cfg.block_size),
            cuda_graphs=engine_cfg.cuda_graphs, compiled=self.compile_decode) if static else None
        self.compile_s = self._warm_up_compiled() if self.decode_runner is not None else 0.0
        if self.decode_runner is not None and engine_cfg.cuda_graph_capture_s > 0:
            with torch.inference_mode():  # every graph now, not while requests wait (no-op off CUDA)
                s = self.decode_runner.capture_at_load(engine_cfg.cuda_graph_capture_s, engine_cfg.max_num_seqs)
            if s:
                log.info("captured %d decode graphs at load in %.1f s", len(self.decode_runner.graphs), s)
        self.decode_kernel = self._resolve_decode_kernel(engine_cfg.decode_attention)
        self.fused = self._resolve_fused(engine_cfg.fused_decode)
        argmax = None
        if self.decode_kernel:  # the paged kernel's module also has a vectorized argmax
            from engines.paged_kernel import load

            argmax = load()[0].argmax_rows
        self.sampler = Sampler(cfg.vocab_size, engine_cfg.seed, self.device, argmax=argmax,
                               grammars=Grammars(tokenizer_bytes(model_dir), cfg.vocab_size))  # lazily built
        self.prompt_tables = SeqTables(cfg.vocab_size, self.device, self.dtype, cfg.n_layer, cfg.kv_heads,
                                       cfg.hd)  # p-tuning, prefill only

    def _resolve_decode_kernel(self, choice: str) -> bool:
        """Whether eager CPU decode steps use engines.paged_kernel (built or loaded here, not in a step)."""
        if choice == "loop" or self.device.type != "cpu":
            return False
        from engines.paged_kernel import load

        mod, why = load()
        if mod is None and choice == "kernel":
            raise RuntimeError(f"decode_attention: 'kernel' but {why}; set decode_attention to auto or loop")
        return mod is not None

    def _resolve_fused(self, choice: str):
        """engines.fused_decode.FusedDecode for this model, or None (off, not applicable, or no build)."""
        if choice == "off" or not self.decode_kernel or self.decode_runner is not None:
            return None
        from engines import fused_decode

        why = fused_decode.why_not(self.model, self.device)
        if why is not None:
            log.info("fused decode step not used: %s", why)
            return None
        mod, why = fused_decode.load()
        if mod is None:
            log.warning("fused decode step not used: %s", why)
            return None
        layers = [self.cache.data[i] for i in range(self.cfg.n_layer)]  # (2, slots, nkv, hd) each
        return fused_decode.FusedDecode(self.model, [kv[0] for kv in layers], [kv[1] for kv in layers])

    @torch.inference_mode()
    def _warm_up_compiled(self) -> float:
        """Compile the decode graphs at load (not in a request's step); seconds spent, logged. Only
        compile_decode "on" compiles (auto resolves to eager on CPU), so a failure is an error."""
        try:
            seconds = self.decode_runner.warm_up()
        except Exception as exc:  # inductor raises many types (C++ build errors, backend failures)
            raise CompileUnavailable(f"compile_decode: 'on' but inductor failed: {exc}") from exc
        if self.decode_runner.compiled is not None:
            log.info("compiled the decode step in %.1f s (inductor cache: %s)", seconds, configure_cache())
        return seconds

    @property
    def model_config(self) -> ModelConfig:
        return self.cfg

    def _eager(self, plan: StepPlan, works: list) -> torch.Tensor:
        ids: list[int] = []
        pos: list[int] = []
        for w in works:
            ids.extend(w.token_ids)
            pos.extend(range(w.start_pos, w.start_pos + len(w.token_ids)))
        input_ids = torch.tensor(ids, device=self.device)[None]  # (1, N)
        positions = torch.tensor(pos, device=self.device)[None]
        backend = PagedAttention(self.cache, plan.decode, plan.prefill, self.device, decode_kernel=self.decode_kernel)
        if (self.fused is not None and not plan.prefill and backend.dec_table is not None
                and self.fused.usable(len(works))):
            return self.fused.run(input_ids, positions, backend.slot_mapping, backend.dec_table, backend.dec_lens,
                                  self.cache.block_size)[0]  # (N, C)
        embeds = None
        if self.prompt_tables.needed(plan.prefill):  # p-tuning: virtual tokens only in prefill chunks
            embeds = self.prompt_tables.embed(self.model.wte, input_ids, works)
            backend.kv_prefix = self.prompt_tables.kv_rows(works)
        return self.model(input_ids, positions, backend, inputs_embeds=embeds)[0]  # (N, C)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.released_seq_ids:
            self.sampler.release(seq_id)
        for init in plan.new_seqs:
            self.sampler.add(init)
        self.prompt_tables.update(plan)
        result = StepResult(step=plan.step)
        if plan.empty:
            return result
        works = [*plan.decode, *plan.prefill]
        self.sampler.prepare([w.seq_id for w in works if w.sample])  # grammar masks overlap the forward
        if (self.decode_runner is not None and not plan.prefill
                and self.decode_runner.bucket_for(plan.decode) is not None):
            hidden = self.decode_runner.run(plan.decode)  # (S, C), padded rows dropped
        else:
            hidden = self._eager(plan, works)

        # rows to turn into logits: the last token of each sampling sequence, then prompt-logprob rows
        sample_rows, sample_ids = [], []
        lp_rows: list[tuple[int, int, int]] = []  # (seq_id, first row, count)
        offset = 0
        for w in works:
            if w.sample:
                sample_rows.append(offset + len(w.token_ids) - 1)
                sample_ids.append(w.seq_id)
            if w.prompt_lp_targets:
                lp_rows.append((w.seq_id, offset + w.prompt_lp_from - w.start_pos, len(w.prompt_lp_targets)))
            offset += len(w.token_ids)
        if sample_rows:
            logits = self.model.logits(hidden if len(sample_rows) == hidden.shape[0]
                                       else hidden[torch.tensor(sample_rows, device=self.device)])
            for seq_id, (tok, lp) in zip(sample_ids, self.sampler.sample(sample_ids, logits)):
                result.seqs[seq_id] = SeqResult(token_id=tok, logprob=lp)
        by_id = {w.seq_id: w for w in works}
        for seq_id, first, count in lp_rows:
            w = by_id[seq_id]
            lp = torch.log_softmax(self.model.logits(hidden[first:first + count]), dim=-1)
            top_n = self.sampler.states[seq_id].init.params.prompt_logprobs or 0
            entries = [Sampler.logprob_entry(lp[j], tok, top_n) for j, tok in enumerate(w.prompt_lp_targets)]
            result.seqs.setdefault(seq_id, SeqResult()).prompt_logprobs = entries
        return result
