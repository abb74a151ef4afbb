"""The model runner: one class for a single device and for every tensor- / pipeline-parallel shard.

A runner holds a stage of the model (layers [start, end) of a ParallelLayout: the first stage embeds,
the last applies the final norm and the LM head; one device is the one stage of every layer), its
slice of each layer on a tensor-parallel rank, the KV cache of those layers, and its communicator
(engines.parallel.comm.Comm: LocalComm, a world of one, on one device). Every rank runs the same
plan: a step's sequences are cut into micro-batches (one unless pipelined); a stage runs micro-batch
m as soon as its input is there (token ids on the first stage, activations received from the
previous stage otherwise) and sends its output on without waiting. The last stage's rows go to
engines.runner.step_head.StepHead, which samples on TP rank 0 of the last stage.

Each micro-batch takes the fastest path that computes it, the same on one device and on a shard:
  static  a decode-only micro-batch through engines.runner.decode_runner (padded buckets, persistent
          buffers): a CUDA graph per bucket on CUDA ("graph"), the inductor-compiled step on CPU
          with compile_decode "on" ("compiled"), else the eager padded step ("static");
  fused   a decode-only micro-batch on CPU through engines.cpu.fused_decode (the blocks in C++; on a
          TP shard one call per half-layer, all-reducing in between);
  eager   the module path (prefill chunks, and what neither of the above takes).
A plan of several greedy decode steps (StepPlan.steps, one device) runs them in the fused step's C++ loop
("fused_steps": embeddings, blocks, head and argmax a step, no Python between tokens), else one step at a time.
`paths` counts the micro-batches of each; `why_not` says why a fast path is off for this runner.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from engines.core.config import EngineConfig, ModelConfig, max_model_len, num_kv_blocks, resolved_dtype
from engines.core.kv_sizing import kv_cache_budget, shard_kv_budget
from engines.core.plan import SeqResult, SeqWork, StepPlan, StepResult
from engines.model.attention import (
    KVCache,
    PagedAttention,
    decode_slots,
    decode_tables,
    long_tensor,
    padded_tables,
)
from engines.parallel.comm import Comm, LocalComm
from engines.parallel.layout import ParallelLayout, local_kv_heads
from engines.parallel.pp import split_microbatches
from engines.runner.compiled import CompileUnavailable, configure_cache, resolve_compile
from engines.runner.decode_runner import DecodeRunner
from engines.runner.grammar import Grammars, tokenizer_bytes
from engines.runner.sampler import Sampler
from engines.runner.step_head import StepHead
from engines.transforms.prompt_inject import SeqTables

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

TP_NOT_COMPILED = ("a tensor-parallel shard all-reduces inside every layer through its communicator (a call "
                   "into the process group) that torch.compile cannot trace into the step's one graph")
"""Why compile_decode 'on' does not compile a TP shard's step (CPU: the fused step runs; CUDA: graphs
of the eager step, NCCL all-reduces captured inside)."""


def without_dropout(model: torch.nn.Module) -> None:
    """Replace every nn.Dropout by nn.Identity in place: a no-op in eval mode either way, but each
    is ~3 us of calls, 25 a GPT-2 token (HF GPT-2 configs ask for 0.1); the engine never trains."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Dropout):
                setattr(parent, name, torch.nn.Identity())


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


class ModelRunner:
    """One device's or one shard's part of every step (see the module doc)."""

    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, model: torch.nn.Module | None = None,
                 layout: ParallelLayout | None = None, rank: int = 0, comm: Comm | None = None):
        """model: a built GPT (one device) or pipeline stage (engines.parallel.pp.StageModel, a shard's,
        already sharded), else loaded here; layout and rank: this shard's place (None: one device);
        comm: its communicator (None: LocalComm)."""
        self.engine_cfg, self.rank, self.comm = engine_cfg, rank, comm or LocalComm()
        self.device = torch.device(engine_cfg.device)
        self.dtype = DTYPES[resolved_dtype(engine_cfg)]  # an engine hands a resolved config; auto here too
        sharded = layout is not None and layout.world_size > 1
        loaded = model is None
        if self.device.type == "cpu":  # the C++ kernels build side by side while the weights load
            from engines.cpu import prebuild

            prebuild.start()
        if loaded and not sharded:
            from engines.loading.checkpoint import load_model

            model, _ = load_model(model_dir, dtype=self.dtype, device=self.device)
        cfg = model.cfg if model is not None else ModelConfig.from_dir(model_dir)
        self.layout = layout or ParallelLayout.build(cfg, 1, 1)
        self.tp_rank, self.pp_rank = self.layout.coords(rank)
        start, end = self.layout.stages[self.pp_rank]
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.layout.pp - 1
        if model is None:
            from engines.parallel.sharded_loading import load_shard

            model = load_shard(model_dir, cfg, start, end, self.comm, self.dtype, self.device, engine_cfg.weight_dtype)
        if loaded:
            without_dropout(model)  # ours alone: a model handed in may still be trained by its owner
        from engines.transforms.fp8 import (
            apply_fp8,  # FP8 block Linears: W8A8 or dequantized, chosen once here
        )

        self.fp8 = apply_fp8(model, engine_cfg.weight_dtype, self.device, self.dtype)
        if engine_cfg.lm_head_dtype == "fp8":  # the logits through an e4m3 copy of the head
            from engines.transforms.fp8 import apply_fp8_head

            log.info("lm_head_dtype fp8: %s", apply_fp8_head(model, self.dtype, model_dir))
        if self.device.type == "cpu":
            from engines.cpu.host_memory import retain_freed_memory

            retain_freed_memory()  # a step's activations reuse freed memory instead of faulting fresh pages in
        if engine_cfg.cpu_linear_autotune and self.device.type == "cpu":
            from engines.cpu.fast_linear import apply_fast_linear

            # in-process steps may run on one thread (engines.cpu.cpu_threads.AdaptiveThreads): time that count too
            # drop_dense: Linears whose decode kernels read their own copy keep no second one (prefill unpacks
            # it per chunk); a compiled step's graph reads the dense weight
            apply_fast_linear(model, single_thread_too=(not sharded and engine_cfg.adaptive_threads
                                                        and engine_cfg.worker_threads == 0),
                              drop_dense=engine_cfg.compile_decode != "on")
        self.model, self.cfg = model, cfg
        """The GPT (one device) or this shard's StageModel: forward(x, positions, backend), logits."""
        self.why_not: dict[str, str] = {}
        """Fast path ("static", "compiled", "fused") -> why this runner does not take it."""
        self.paths: Counter[str] = Counter()
        """Micro-batches run by each path: graph, compiled, static, fused, eager."""
        self._build_cache_and_static(cfg, engine_cfg, end - start)
        self.decode_kernel = self._resolve_decode_kernel(engine_cfg.decode_attention)
        self.fused = self._resolve_fused(engine_cfg.fused_decode)
        self.samples = self.last and self.tp_rank == 0
        argmax = None
        if self.decode_kernel and self.samples:  # the paged kernel's module also has a vectorized argmax
            from engines.cpu.paged_kernel import load

            argmax = load()[0].argmax_rows
        sampler = Sampler(cfg.vocab_size, engine_cfg.seed, self.device, argmax=argmax,
                          grammars=Grammars(tokenizer_bytes(model_dir), cfg.vocab_size)) if self.samples else None
        self.sampler = sampler  # grammars lazily built
        screen = None
        if (self.samples and self.comm.tp_size == 1 and engine_cfg.greedy_head_screen and self.device.type == "cpu"
                and self.dtype == torch.float32 and engine_cfg.lm_head_dtype == "auto"):
            from engines.cpu.greedy_head import build_screen

            screen, why = build_screen(getattr(model, "lm_head", None), cfg.vocab_size)
            log.info("greedy_head_screen: %s%s", "on, " if screen is not None else "off: ", why)
        self.head = StepHead(model, self.comm, sampler, cfg.vocab_size, self.tp_rank, screen) if self.last else None
        # p-tuning: input tasks' embedding rows on the first stage, every-layer tasks' keys/values on
        # every rank (its layers and KV heads); prefill only
        self.prompt_tables = SeqTables(cfg.vocab_size, self.device, self.dtype, cfg.n_layer, cfg.kv_heads, cfg.hd,
                                       layers=(start, end), local_kv=local_kv_heads(cfg, self.layout.tp, self.tp_rank))
        self.spans: list[tuple[float, float, float]] = []
        """(start, end, busy seconds) of each step, for the pipeline bubble measurement."""

    def _build_cache_and_static(self, cfg: ModelConfig, engine_cfg: EngineConfig, n_layers: int) -> None:
        """The KV cache of this runner's layers and KV heads, and the static decode runner (or why not)."""
        if self.layout.world_size > 1:  # every shard must reach the same count without talking
            self.num_blocks = shard_num_blocks(cfg, engine_cfg, self.layout)
        else:
            budget = None if engine_cfg.num_kv_blocks else kv_cache_budget(cfg, engine_cfg, self.device)
            self.num_blocks = num_kv_blocks(cfg, engine_cfg, budget)
        self.compile_decode, why = resolve_compile(engine_cfg.compile_decode, self.device)
        if engine_cfg.compile_decode != "off":
            log.info(why)
        if self.compile_decode and self.comm.tp_size > 1:
            self.compile_decode = False
            self.why_not["compiled"] = TP_NOT_COMPILED
            log.info("compile_decode: not on this shard: %s", TP_NOT_COMPILED)
        elif not self.compile_decode:
            self.why_not["compiled"] = why
        static = engine_cfg.static_decode == "on" or (engine_cfg.static_decode == "auto" and (
            self.device.type == "cuda" or self.compile_decode))
        if not static:
            self.why_not["static"] = f"static_decode {engine_cfg.static_decode} on {self.device.type}"
        if static and self.num_blocks > 1:
            self.num_blocks -= 1  # the last block is the decode runner's null block (padded rows)
        self.cache = KVCache(n_layers, self.num_blocks + static, engine_cfg.block_size,
                             local_kv_heads(cfg, self.layout.tp, self.tp_rank)[1], cfg.hd, self.dtype, self.device)
        self.decode_runner = DecodeRunner(
            self.model, self.cache, null_block=self.num_blocks,
            max_blocks_per_seq=-(-max_model_len(cfg, engine_cfg) // engine_cfg.block_size),
            cuda_graphs=engine_cfg.cuda_graphs, compiled=self.compile_decode,
            comm=self.comm if self.layout.world_size > 1 else None) if static else None
        self.compile_s = self._warm_up_compiled() if self.decode_runner is not None else 0.0
        if self.decode_runner is not None and engine_cfg.cuda_graph_capture_s > 0:
            with torch.inference_mode():  # every graph now, not while requests wait (no-op off CUDA)
                s = self.decode_runner.capture_at_load(engine_cfg.cuda_graph_capture_s, engine_cfg.max_num_seqs)
            if s:
                log.info("captured %d decode graphs at load in %.1f s", len(self.decode_runner.graphs), s)

    def _resolve_decode_kernel(self, choice: str) -> bool:
        """Whether eager CPU decode steps use engines.cpu.paged_kernel (built or loaded here, not in a step)."""
        if choice == "loop" or self.device.type != "cpu":
            return False
        from engines.cpu.paged_kernel import load

        mod, why = load()
        if mod is None and choice == "kernel":
            raise RuntimeError(f"decode_attention: 'kernel' but {why}; set decode_attention to auto or loop")
        return mod is not None

    def _resolve_fused(self, choice: str):
        """engines.cpu.fused_decode.FusedDecode for this model or stage, or None (the reason in why_not)."""
        why = ("fused_decode off" if choice == "off" else "decode attention is not the paged kernel"
               if not self.decode_kernel else "the static decode runner takes decode steps"
               if self.decode_runner is not None else None)
        fused = None
        if why is None:
            from engines.cpu import fused_decode

            why = fused_decode.why_not(self.model, self.device)
            if why is None:
                mod, why = fused_decode.load()
                if mod is not None:
                    why = None
                    layers = [self.cache.data[i] for i in range(self.cache.data.shape[0])]  # (2, slots, nkv, hd)
                    fused = fused_decode.FusedDecode(self.model, [kv[0] for kv in layers], [kv[1] for kv in layers])
                else:
                    log.warning("fused decode step not used: %s", why)
            else:
                log.info("fused decode step not used: %s", why)
        if why is not None:
            self.why_not["fused"] = why
        return fused

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

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run this runner's part of the step; the step result on the sampling rank, None elsewhere."""
        return self.run(plan)[0]

    @torch.inference_mode()
    def run(self, plan: StepPlan, want_logits: bool = False
            ) -> tuple[StepResult | None, dict[int, torch.Tensor] | None]:
        """Run this runner's part of the step. The sampling rank returns (result, logits of each
        sampled sequence if want_logits); every other rank returns (None, None)."""
        t0 = time.perf_counter()
        if self.head is not None:
            self.head.update(plan)
        self.prompt_tables.update(plan)
        result = StepResult(step=plan.step) if self.samples else None
        if plan.empty:
            return result, None
        if plan.steps > 1:
            tb = time.perf_counter()
            self._run_steps(plan, result)
            self.spans.append((t0, time.perf_counter(), time.perf_counter() - tb))
            return result, None
        works = [*plan.decode, *plan.prefill]
        n_decode = len(plan.decode)
        if self.sampler is not None:  # grammar masks overlap the forward
            self.sampler.prepare([w.seq_id for w in works if w.sample])
        busy = 0.0
        for m, group in enumerate(split_microbatches(works, self.layout.microbatches(self.engine_cfg,
                                                                                    plan.num_tokens))):
            decode = [works[i] for i in group if i < n_decode]
            prefill = [works[i] for i in group if i >= n_decode]
            n = sum(len(w.token_ids) for w in (*decode, *prefill))
            x = None if self.first else self.comm.recv_prev((1, n, self.cfg.n_embd), self.dtype, tag=m)  # (1, n, C)
            tb = time.perf_counter()
            hidden = self._forward(decode, prefill, x)  # (n, C)
            if not self.last:
                self.comm.send_next(hidden[None], tag=m)
            else:
                self.head.add_rows([*decode, *prefill], hidden)
            busy += time.perf_counter() - tb
        self.comm.flush()
        logits_out = None
        if self.last:
            tb = time.perf_counter()
            logits_out = self.head.sample(result, want_logits)
            busy += time.perf_counter() - tb
        self.spans.append((t0, time.perf_counter(), busy))
        return result, logits_out

    @property
    def multi_step(self) -> bool:
        """Whether this runner takes plans of several decode steps (StepPlan.steps): the whole model on one device."""
        return self.first and self.last and self.samples and self.comm.tp_size == 1

    def _run_steps(self, plan: StepPlan, result: StepResult) -> None:
        """A plan of plan.steps greedy decode steps (decode rows only, each plain greedy: engines/core/scheduler.py):
        each row's tokens into result (SeqResult.token_id, then .more), fewer than plan.steps where a row drew a stop
        token (its EOS unless ignore_eos, its stop_token_ids) before the last. Through the fused step's C++ loop where
        it runs these rows (engines/cpu/fused_decode.py run_steps), else one step at a time here: the same tokens."""
        decode = plan.decode
        states = [self.sampler.states[w.seq_id] for w in decode]
        stops = [[*(() if st.init.params.ignore_eos else st.init.eos_token_ids), *st.init.params.stop_token_ids]
                 for st in states]
        why = ("fused_decode off" if self.fused is None or not self.decode_kernel
               else self.fused.steps_why_not(len(decode)))
        screen = self.head.screen if self.head.screen is not None and self.head.screen.applies(len(decode)) else None
        if why is None:
            self.paths["fused_steps"] += 1
            tokens = self.fused.run_steps([w.token_ids[0] for w in decode], [w.start_pos for w in decode],
                                          padded_tables([w.block_ids for w in decode]), self.cache.block_size,
                                          plan.steps, stops, self.cfg.vocab_size, screen).T.tolist()  # (M, n)
            for st, toks in zip(states, tokens):
                st.num_output += len(toks)
        else:
            self.why_not["fused_steps"] = why
            tokens = [[] for _ in decode]
            feed = decode
            for _ in range(plan.steps):
                hidden = self._forward(feed, [], None)  # (M, C)
                step = StepResult(step=plan.step)
                self.head.add_rows(feed, hidden)
                self.head.sample(step, False)
                new = [step.seqs[w.seq_id].token_id for w in decode]
                for toks, tok in zip(tokens, new):
                    toks.append(tok)
                if any(tok in stop for tok, stop in zip(new, stops)):
                    break
                feed = [replace(w, token_ids=[tok], start_pos=w.start_pos + 1) for w, tok in zip(feed, new)]
        for w, toks in zip(decode, tokens):
            result.seqs[w.seq_id] = SeqResult(token_id=toks[0], more=toks[1:])

    def _forward(self, decode: list[SeqWork], prefill: list[SeqWork], x: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through this runner's layers: x is the received hidden states (1, n, C) on a
        later stage (None on the first) -> hidden states (n, C), after the final norm on the last."""
        dr = self.decode_runner
        if not prefill and dr is not None and dr.bucket_for(decode) is not None:
            self.paths[dr.kind] += 1
            hidden = dr.run(decode) if x is None else dr.run(decode, x[0])  # (S, C), padded rows dropped
            # a graph's output buffer is overwritten by the next replay, maybe before the send completes
            return hidden.clone() if dr.cuda_graphs and not self.last else hidden
        if (decode and not prefill and self.fused is not None and self.decode_kernel and self.device.type == "cpu"
                and self.fused.usable(len(decode))):  # one token a row: no PagedAttention to build
            self.paths["fused"] += 1
            table, lens = decode_tables(decode)
            rows = long_tensor([[w.token_ids[0] for w in decode], [w.start_pos for w in decode],
                                decode_slots(decode, self.cache.block_size)])  # (3, M) ids, positions, slots
            return self.fused.run(rows[:1] if self.first else x, rows[1:2], rows[2], table, lens,
                                  self.cache.block_size)[0]  # (M, C)
        works = [*decode, *prefill]
        ids: list[int] = []
        pos: list[int] = []
        for w in works:
            ids.extend(w.token_ids)
            pos.extend(range(w.start_pos, w.start_pos + len(w.token_ids)))
        positions = long_tensor(pos).to(self.device)[None]  # (1, n)
        if self.first:
            x = long_tensor(ids).to(self.device)[None]  # (1, n) token ids
        backend = PagedAttention(self.cache, decode, prefill, self.device, decode_kernel=self.decode_kernel)
        embeds = None
        if self.prompt_tables.needed(works):  # p-tuning: virtual tokens only in prefill chunks
            backend.kv_prefix = self.prompt_tables.kv_rows(works)
            if self.first:  # every TP rank of the stage: the lookup all-reduces
                embeds = self.prompt_tables.embed(self.model.wte, x, works)
        self.paths["eager"] += 1
        return self.model(x, positions, backend, inputs_embeds=embeds)[0]  # (n, C)
