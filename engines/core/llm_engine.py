"""The engine: requests in, incremental outputs out, one schedule -> execute -> update step at a time.

Not thread-safe: one thread drives it (the offline LLM, or the AsyncLLMEngine's loop thread).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path

from engines.core.block_manager import cache_key
from engines.core.config import EngineConfig, ModelConfig, max_model_len, resolve_engine_config
from engines.core.executor import Executor, InProcessExecutor
from engines.core.outputs import CompletionOutput, RequestOutput
from engines.core.plan import StepPlan, StepResult, TokenLogprob
from engines.core.sampling_params import RequestError, SamplingParams, generation_defaults
from engines.core.scheduler import Scheduler, SchedulerConfig
from engines.core.sequence import Sequence
from engines.core.step_record import StepRecorder
from engines.loading.checkpoint import CheckpointError
from engines.loading.model_source import resolve_model
from engines.loading.tokenizer import Detokenizer, Tokenizer
from engines.transforms.ptuning import ModelShape, Task, TaskRegistry, attach_tables, virtual_ids

log = logging.getLogger(__name__)

STEP_LOG_LEN = 256
"""Working steps kept in LLMEngine.step_log (a replica's admission fits step time to tokens from it)."""

Prompt = str | list[int]
ExecutorFactory = Callable[[str, EngineConfig], Executor]


@dataclass
class _Completion:
    seq: Sequence
    detok: Detokenizer | None
    text: str = ""
    """All decoded text (including what is held back while it may start a stop string)."""
    emitted: int = 0
    """Characters of `text` already sent."""
    logprobs: list[TokenLogprob] | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_lp_sent: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    task: Task | None = None
    """P-tuning: the task snapshot this request runs with (its table never changes under it)."""

    @property
    def finished(self) -> bool:
        for c in self.completions:  # (a loop: ~3x faster than all() over a generator, asked per request a step)
            if not c.seq.finished:
                return False
        return True


class LLMEngine:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig | None = None,
                 executor_factory: ExecutorFactory | None = None, step_recorder: StepRecorder | None = None):
        """step_recorder: where working steps are recorded (engines/core/step_record.py); None records into
        a new one of EngineConfig.step_record_len steps."""
        model_dir = resolve_model(model_dir)  # a .gguf file: its cached import (engines/loading/model_source.py)
        self.model_dir = str(model_dir)
        d = Path(model_dir)
        if not d.is_dir():
            raise CheckpointError(f"model directory {str(d)!r} does not exist or is not a directory")
        # dtype "auto" becomes the concrete dtype here, once, before any executor or worker sees it
        self.config = resolve_engine_config(engine_config or EngineConfig(), _model_config_or_none(d))
        self.tokenizer = Tokenizer.from_dir(d)
        self.sampling_defaults = generation_defaults(d)
        """SamplingParams fields from generation_config.json: the defaults of requests that leave them unset."""
        if executor_factory is None and self.config.world_size > 1:
            from engines.parallel import make_executor_factory  # TP x PP shards in worker processes

            executor_factory = make_executor_factory(self.config)
        self.executor = (executor_factory or InProcessExecutor)(self.model_dir, self.config)
        self.model_config: ModelConfig = self.executor.model_config
        eos = tuple(self.model_config.eos_token_id)
        if not eos and self.tokenizer is not None and self.tokenizer.token_id(self.tokenizer.eos_token) is not None:
            eos = (self.tokenizer.token_id(self.tokenizer.eos_token),)
        self.eos_token_ids = eos
        self.max_model_len = max_model_len(self.model_config, self.config)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            block_size=self.config.block_size, num_blocks=self.executor.num_blocks,
            max_model_len=self.max_model_len, eos_token_ids=eos,
            admission_reserves_growth=self.config.admission_reserves_growth,
            admission_overtakes=self.config.admission_overtakes,
            whole_prompt_steps=self.config.whole_prompt_steps,
            enable_prefix_caching=self.config.enable_prefix_caching))
        self._max_steps = self.config.decode_steps if self.executor.multi_step else 1
        """Decode steps an offline step (final_only) may run in one plan (EngineConfig.decode_steps)."""
        self.tasks = TaskRegistry(model_dir, ModelShape.of(self.model_config))
        """P-tuned tasks (engines/transforms/ptuning.py); requests name one to prepend its virtual tokens."""
        self._task_keys: dict[str, tuple[object, bytes]] = {}
        """Task name -> (the table it was computed from, prefix-cache key): see _cache_key."""
        self.requests: dict[str, _Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.busy_seconds = 0.0
        """Steps that ran work, and the wall time they took (scheduling, model, sampling, outputs)."""
        self.step_log: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=STEP_LOG_LEN)
        """(end, tokens, seconds) of the latest working steps: end on time.monotonic(), tokens the step
        computed (one per decode, a chunk per prefill). Read by other threads: copy it with tuple()."""
        self.step_recorder = step_recorder if step_recorder is not None else StepRecorder(self.config.step_record_len)
        """The same steps in detail (engines.core.step_record.STEP_FIELDS), for the tuner's served-step fit."""
        self._busy_end: float | None = None
        self.step_in_flight: tuple[float, int] | None = None
        """(start on time.monotonic(), tokens) of the step running now; None between steps."""
        self.cache_mapped = bool(self.config.kv_cache_bytes or self.config.num_kv_blocks) and self._map_cache()
        """Whether the KV cache was mapped whole here (a cache the user sized): see _map_cache."""

    def _map_cache(self) -> bool:
        """Map a cache whose size the user set before the engine runs, as vLLM and TensorRT-LLM allocate theirs up
        front, so that no step writes a fresh page. Mapped on first write instead, the SmolLM2 fp32 HTTP mix's
        first 64-stream burst on a fresh server (2-core EPYC VM, where the hypervisor backs a guest page on its
        first touch: 5-9 s a GiB) spent 15-20 % of the CPU zeroing pages, its prefill steps ~5.3 s against ~3.2 s,
        TTFT p90 17-19 s against 13 s; a serving engine's idle loop cannot map ahead of a burst that comes seconds
        after the last (engines/core/async_engine.py). A cache sized from free memory is mapped as it is used (and
        ahead, in a serving engine, while idle): it may be most of the host's memory. True once all is mapped (or
        nothing here is to map: a device cache, shards in other processes)."""
        t = time.perf_counter()
        mapped = self.executor.prefault(1 << 62, self.executor.num_blocks)
        self.scheduler.blocks.mapped = mapped
        if time.perf_counter() - t > 1:
            log.info("mapped the KV cache's %d blocks in %.1f s", mapped, time.perf_counter() - t)
        return mapped >= self.executor.num_blocks

    # requests
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text or None, token ids)."""
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt: must not be empty", param="prompt")
            if self.tokenizer is None:
                raise RequestError("prompt: this model has no tokenizer.json; send token ids instead",
                                   param="prompt")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise RequestError("prompt: encodes to zero tokens", param="prompt")
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
            raise RequestError("prompt: must be a string or a list of token ids (integers)", param="prompt")
        if not prompt:
            raise RequestError("prompt: must not be empty", param="prompt")
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise RequestError(f"prompt: token id {t} at position {i} is outside the vocabulary [0, {vocab})",
                                   param="prompt", code="invalid_token_id")
        return None, list(prompt)

    def validate(self, prompt: Prompt, params: SamplingParams, task: str | None = None
                 ) -> tuple[str | None, list[int]]:
        """Every check a request must pass before it enters the queue; raises RequestError
        (UnknownTaskError, code task_not_found, for a task that is not loaded)."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params: must be a SamplingParams", param="sampling_params")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise RequestError(f"{name}: at most {self.config.max_logprobs}, got {v}", param=name)
        text, ids = self.tokenize(prompt)
        n_virtual = self.tasks.get(task).num_virtual_tokens if task is not None else 0
        self.scheduler.check_fits(n_virtual + len(ids), params.max_tokens)  # virtual tokens count
        return text, ids

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    validated: tuple[str | None, list[int]] | None = None, task: str | None = None) -> None:
        params = params or SamplingParams(**self.sampling_defaults)  # generation_config.json defaults
        if request_id in self.requests:
            raise RequestError(f"request_id: {request_id!r} is already running", param="request_id")
        text, ids = validated if validated is not None else self.validate(prompt, params, task)
        snap = self.tasks.get(task) if task is not None else None  # this request's table from now on
        virt = virtual_ids(self.model_config.vocab_size, snap.num_virtual_tokens) if snap is not None else []
        if virt and validated is not None:  # the task may have been replaced since validation
            self.scheduler.check_fits(len(virt) + len(ids), params.max_tokens)
        comps = []
        key = self._cache_key(snap)
        for i in range(params.n):
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=virt + list(ids),
                           prompt_len=len(virt) + len(ids), params=params,
                           prompt_logprobs_done=len(virt),  # no logprobs for virtual positions
                           cache_key=key)
            self._seqs[seq.seq_id] = seq
            detok = self.tokenizer.detokenizer(ids, params.skip_special_tokens) if self.tokenizer else None
            comps.append(_Completion(seq, detok, logprobs=[] if params.logprobs is not None else None))
            self.scheduler.add(seq)
        req = _Request(request_id, text, ids, params, comps,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None, task=snap)
        req.metrics["arrival_time"] = time.monotonic()
        self.requests[request_id] = req

    def _cache_key(self, task: Task | None) -> bytes:
        """Prefix-cache key of a request's sequences: b"" for the base model; for a task, its name
        and the digest of its table, so that no other task, the base model, or the same task
        after its table was replaced, ever reads its blocks (virtual ids are the same for all)."""
        if task is None:
            return b""
        memo = self._task_keys.get(task.name)
        if memo is None or memo[0] is not task.table:
            digest = hashlib.sha256(task.table.tobytes()).digest()
            memo = self._task_keys[task.name] = (task.table, cache_key("ptuning", task.name, digest))
        return memo[1]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its KV blocks return to the pool before this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for c in req.completions:
            if not c.seq.finished:
                self.scheduler.finish(c.seq, "abort")
            self._seqs.pop(c.seq.seq_id, None)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's contents (running sequences keep their blocks); the blocks forgotten."""
        return self.scheduler.blocks.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": self.scheduler.blocks.usage, "num_preemptions": self.scheduler.num_preemptions,
                "num_steps": self.num_steps, "busy_seconds": self.busy_seconds,
                "prefix_cache_queries": self.scheduler.blocks.query_tokens,
                "prefix_cache_hits": self.scheduler.blocks.hit_tokens}

    # the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it moved (their new text and tokens), or with final_only
        those of the requests it finished only (an offline caller that waits for whole requests: LLM.generate; no
        output is built for the others, whose text still accumulates; its plans may run several greedy decode steps:
        EngineConfig.decode_steps)."""
        t0, started = time.perf_counter(), time.monotonic()
        plan = self.scheduler.schedule(self._max_steps if final_only else 1)
        if plan.empty and not plan.released_seq_ids:
            return []
        tokens = sum(len(w.token_ids) for w in (*plan.decode, *plan.prefill))
        gap = started - self._busy_end if self._busy_end is not None else -1.0
        self.step_in_flight = (started, tokens)
        attach_tables(plan, lambda seq_id: self.requests[self._seqs[seq_id].request_id].task)
        subs: list[StepPlan] = [plan]
        try:
            return self._step(plan, final_only, subs)
        finally:
            seconds = time.perf_counter() - t0
            self.num_steps += 1
            self.busy_seconds += seconds
            self.step_in_flight = None
            end = time.monotonic()
            if tokens:  # a plan of several steps: each as a step of its share of the time
                for i, sub in enumerate(subs):
                    self.step_log.append((end, tokens, seconds / len(subs)))
                    self.step_recorder.record(end, seconds / len(subs), gap if i == 0 else 0.0, sub)
            self._busy_end = end if self.requests else None

    def _step(self, plan: StepPlan, final_only: bool = False, subs: list[StepPlan] | None = None
              ) -> list[RequestOutput]:
        """Run `plan` and take its tokens; subs: filled with the plan's steps (one plan a step it ran)."""
        result = self.executor.execute(plan)
        now = time.monotonic()
        steps = one_step_plans(plan, result)
        if subs is not None:
            subs[:] = steps
        for j, sub in enumerate(steps):  # a plan of several steps: its tokens one step at a time, as single steps
            touched = self.scheduler.update(sub, result, self._seqs, lambda r, j=j: r.token_at(j))
            for seq in touched:
                req = self.requests[seq.request_id]
                req.metrics.setdefault("first_token_time", now)
                self._on_token(req, req.completions[seq.index])
        changed: dict[str, _Request] = {}
        for work in (*plan.decode, *plan.prefill):
            seq = self._seqs.get(work.seq_id)
            if seq is None:
                continue
            req = self.requests[seq.request_id]
            req.metrics.setdefault("first_scheduled_time", now)
            res = result.seqs.get(work.seq_id)
            if res is not None and res.prompt_logprobs and req.prompt_logprobs is not None and seq.index == 0:
                req.prompt_logprobs.extend(res.prompt_logprobs)
            if res is not None and res.logprob is not None:
                req.completions[seq.index].logprobs.append(res.logprob)
            changed[req.request_id] = req
        outputs = []
        for req in changed.values():
            if req.finished:
                req.metrics["finished_time"] = now
                del self.requests[req.request_id]
                for c in req.completions:
                    self._seqs.pop(c.seq.seq_id, None)
            if req.finished or not final_only and any(c.seq.num_output > c.sent_tokens or c.seq.finished
                                                      for c in req.completions):
                outputs.append(self._output(req))
        return outputs

    def _on_token(self, req: _Request, comp: _Completion) -> None:
        seq, p = comp.seq, req.params
        prev_len = len(comp.text)
        if comp.detok is not None:
            # EOS or a stop token id: its own text is not output (unless include_stop_str_in_output)
            by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            if not by_token or p.include_stop_str_in_output:
                comp.text += comp.detok.step(seq.token_ids[-1])
            if seq.finished:  # no token follows: send what waited for the rest of a UTF-8 character
                comp.text += comp.detok.flush()
        # stop strings outrank the length limit (the token that reached max_tokens may complete one)
        if p.stop and seq.finish_reason in (None, "length") and seq.num_output >= p.min_tokens:
            # only a stop string that ends in this token's text counts: one wholly in earlier text
            # was either checked already or came before min_tokens allowed stopping
            hits = [(comp.text.find(s, max(0, prev_len - len(s) + 1)), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                comp.text = comp.text[:i + len(s)] if p.include_stop_str_in_output else comp.text[:i]
                if seq.finished:
                    seq.finish_reason, seq.stop_reason = "stop", s
                else:
                    self.scheduler.finish(seq, "stop", s)

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for c in req.completions:
            seq, p = c.seq, req.params
            # hold back a tail that may still grow into a stop string
            hold = 0 if seq.finished or not p.stop else max(len(s) for s in p.stop) - 1
            upto = max(c.emitted, len(c.text) - hold)
            delta_text = c.text[c.emitted:upto]
            c.emitted = upto
            out_ids = seq.output_token_ids
            delta_ids = out_ids[c.sent_tokens:]
            c.sent_tokens = len(out_ids)
            delta_lp: list[TokenLogprob] = []
            if c.logprobs is not None:
                delta_lp = c.logprobs[c.sent_logprobs:]
                c.sent_logprobs = len(c.logprobs)
            outs.append(CompletionOutput(
                index=c.seq.index, text=c.text[:upto], token_ids=out_ids,  # out_ids: a fresh slice
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                text_delta=delta_text, token_ids_delta=delta_ids, logprobs_delta=delta_lp))
        prompt_lp = None
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) == len(req.prompt_ids):
            prompt_lp = req.prompt_logprobs
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
                             outputs=outs, prompt_logprobs=prompt_lp, finished=req.finished,
                             metrics=dict(req.metrics), task=req.task.name if req.task else None,
                             num_virtual_tokens=req.task.num_virtual_tokens if req.task else 0,
                             num_cached_tokens=max(0, req.completions[0].seq.num_cached_tokens))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (the executor failed)."""
        outs = []
        for rid in list(self.requests):
            out = self.abort_request(rid)
            if out is not None:
                out.error = message
                outs.append(out)
        return outs

    def shutdown(self) -> None:
        self.executor.shutdown()


def one_step_plans(plan: StepPlan, result: StepResult) -> list[StepPlan]:
    """The steps a plan ran: itself, or for a plan of several decode steps (StepPlan.steps) one plan a step it ran, each
    row's input the token drawn before and its position one on (its rows ran as many steps: SeqResult.more)."""
    if plan.steps == 1 or not plan.decode:
        return [plan]
    n = 1 + len(result.seqs[plan.decode[0].seq_id].more)
    return [plan] + [StepPlan(step=plan.step, decode=[
        replace(w, token_ids=[result.seqs[w.seq_id].token_at(j - 1)], start_pos=w.start_pos + j) for w in plan.decode])
        for j in range(1, n)]


def _model_config_or_none(model_dir: Path) -> ModelConfig | None:
    """The checkpoint's shapes for the dtype probe; None lets the executor report a bad config."""
    try:
        return ModelConfig.from_dir(model_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class LLM:
    """Offline batch generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | Path, dtype: str = "auto", **engine_options):
        unknown = set(engine_options) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(EngineConfig.field_names())}")
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json values (temperature, top_p,
        top_k, repetition_penalty, max_new_tokens) over SamplingParams' own defaults, as vLLM's
        LLM.get_default_sampling_params; what generate() uses when given no sampling_params."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's contents (as vLLM's LLM.reset_prefix_cache): the next requests compute
        their prompts afresh, as on a new engine. Returns the blocks forgotten."""
        return self.engine.reset_prefix_cache()

    def load_task(self, name: str, path: str | Path | None = None) -> Task:
        """Load (or replace) a p-tuned task from a PEFT adapter directory (default <model>/ptuning/<name>)."""
        return self.engine.tasks.load(name, path)

    def unload_task(self, name: str) -> bool:
        """Forget a task; requests already running keep its table. Returns whether it was loaded."""
        return self.engine.tasks.unload(name)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, task: str | Seq[str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        task: a loaded p-tuned task for every prompt, or a list with one task (or None) per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or token ids
        prompts = list(prompts)
        if sampling_params is None:  # the checkpoint's generation_config.json defaults, as vLLM
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else (
            [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        tasks = list(task) if isinstance(task, (list, tuple)) else [task] * len(prompts)
        if len(tasks) != len(prompts):
            raise ValueError(f"task: {len(tasks)} given for {len(prompts)} prompts")
        validated = [self.engine.validate(p, sp, t) for p, sp, t in zip(prompts, params, tasks)]  # all or nothing
        ids = []
        for p, sp, v, t in zip(prompts, params, validated, tasks):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, p, sp, validated=v, task=t)
            ids.append(rid)
        bar = _progress(len(ids)) if use_tqdm else None
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(final_only=True):
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # engines/ runs with torch alone; the bar is optional there
        return None
    return tqdm(total=total, desc="generate", unit="req")
