"""The model side of serving: one AsyncLLMEngine and the policies around it.

A ModelCore admits requests up to a bound (429 beyond), enforces the per-request timeout, turns
engine outputs into coalesced `GenerateChunk`s, records metrics, and drains on shutdown. The Ray
Serve ModelServer replica and the in-process backend both run this class, so the two paths share
every behaviour. Leaving a `generate` iteration early (client gone, Ray cancellation) aborts the
engine requests, whose KV blocks are free within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from engines.core.sampling_params import RequestError, SamplingParams
from serving import errors
from serving.admission import EngineView, TtftAdmission
from serving.limits import prompt_params
from serving.metrics import ReplicaMetrics
from serving.wire import Delta, ErrorInfo, GenerateChunk, GenerateRequest, ModelInfo

if TYPE_CHECKING:
    from deploy.schema import ModelSpec
    from engines.core.async_engine import AsyncLLMEngine
    from engines.core.outputs import RequestOutput
    from serving.ptuning_ops import PtuningOp

log = logging.getLogger("shardserve.model")

ADAPTIVE_CHUNK_RATE = 400.0
"""With stream_interval_ms = 0, a replica aims at no more than this many streamed chunks per second
in total: the least interval between two chunks of one request is (active requests / this), kept
within [MIN_ADAPTIVE_INTERVAL_S, MAX_ADAPTIVE_INTERVAL_S]; 64 concurrent requests stream about
every 160 ms. Each chunk costs a Ray object on two hops and an HTTP write (about a millisecond of
CPU on a small machine, partly in the engine's own process); tokens are never dropped, only sent
together, and the first chunk of a request is never held."""
MIN_ADAPTIVE_INTERVAL_S = 0.02
"""50 chunks/s for a lone request: smooth to read, and a fraction of the engine's step rate."""
MAX_ADAPTIVE_INTERVAL_S = 0.25
WATCH_INTERVAL_S = 0.01
"""With a TTFT SLO, how often requests still waiting for a first token are judged again (a fraction
of an engine step on a small machine; the check is a walk over the waiting requests)."""


class ModelCore:
    def __init__(self, spec: ModelSpec, engine: AsyncLLMEngine, replica: str = "local",
                 request_timeout_s: float = 600.0):
        self.spec = spec
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.replica = replica
        cfg = engine.engine.config
        self.capacity = cfg.max_num_seqs + spec.max_waiting
        """Sequences admitted at once (running + waiting)."""
        self.admitted = 0
        self.ttft_admission = TtftAdmission(None if spec.ttft_slo_ms is None else spec.ttft_slo_ms / 1000.0,
                                            cfg.max_num_seqs, cfg.max_num_batched_tokens)
        """Refuses what would wait past spec.ttft_slo_ms for a first token (serving/admission.py)."""
        self._awaiting_first: dict[str, _Waiting] = {}
        """Admitted requests with no first token yet, in admission order."""
        self._watcher: asyncio.Task | None = None
        self.active_requests = 0
        self.draining = False
        from engines.loading.checkpoint import served_weight_dtype

        weight_dtype = served_weight_dtype(spec.path, cfg.weight_dtype, cfg.dtype)
        self.metrics = ReplicaMetrics(spec.name, replica, self.stats, weight_dtype=weight_dtype, dtype=cfg.dtype)
        tk = engine.tokenizer
        self.info = ModelInfo(
            name=spec.name, max_model_len=engine.engine.max_model_len,
            vocab_size=engine.engine.model_config.vocab_size, max_logprobs=cfg.max_logprobs,
            max_seqs_per_request=self.capacity, tokenizer_json=tk.tk.to_str() if tk is not None else None,
            chat_template=tk.chat_template if tk is not None else None,
            bos_token=tk.bos_token if tk is not None else None, eos_token=tk.eos_token if tk is not None else None,
            created=int(time.time()), weight_dtype=weight_dtype, step_record_len=engine.engine.step_recorder.capacity,
            sampling_defaults=dict(engine.engine.sampling_defaults))
        from serving.ptuning_admin import PtuningAdmin

        self.ptuning = PtuningAdmin(spec.name, spec.path, engine.engine.tasks)
        """P-tuned tasks from the model's ptuning/ folder (loaded now, re-scanned while serving)."""

    @classmethod
    def load(cls, spec: ModelSpec, replica: str = "local", request_timeout_s: float = 600.0,
             executor_factory: Callable | None = None) -> ModelCore:
        """Build the engine of `spec` (loads the checkpoint; seconds)."""
        from engines import AsyncLLMEngine, ConfigError, EngineConfig

        try:
            cfg = EngineConfig(**spec.engine.engine_kwargs())
        except ConfigError as exc:
            raise ConfigError(f"models[{spec.name}].engine.{exc}") from None
        engine = AsyncLLMEngine.from_model_dir(spec.path, cfg, executor_factory=executor_factory)
        return cls(spec, engine, replica, request_timeout_s)

    async def ptuning_admin(self, op: PtuningOp) -> tuple[ErrorInfo | None, Any]:
        """(ErrorInfo or None, result) of a p-tuning admin operation (serving/ptuning_ops.py)."""
        self.ptuning.ensure_watch()
        return await asyncio.to_thread(self.ptuning.run, op)

    def step_window(self) -> dict:
        """This replica's window as published (serving/steps_api.py answers with it): its layout, replica name,
        `clock_s` (now on the replica's monotonic clock: how old each step is) and the engine's latest steps as
        tuples in engines.core.step_record.STEP_FIELDS order (published every metrics push: tuples pickle several
        times faster than dicts, for thousands of steps), from the step recorder (EngineConfig.step_record_len)."""
        c = self.engine.engine.config
        layout = {"tensor_parallel_size": c.tensor_parallel_size, "pipeline_parallel_size": c.pipeline_parallel_size,
                  "worker_threads": c.worker_threads, "max_num_seqs": c.max_num_seqs,
                  "max_num_batched_tokens": c.max_num_batched_tokens, "dtype": c.dtype}
        return {"replica": self.replica, "layout": layout, "clock_s": time.monotonic(),
                "rows": self.engine.engine.step_recorder.rows()}

    # health and state
    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "num_admitted": self.admitted}

    def check_health(self) -> None:
        """Raises EngineDeadError once the engine loop has failed (Ray Serve then replaces us)."""
        self.engine.check_health()

    def ready(self) -> bool:
        try:
            self.check_health()
        except Exception:  # noqa: BLE001 - any failure means not ready
            return False
        return not self.draining

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Refuse new requests, let admitted ones finish for up to drain_timeout_s, abort the rest."""
        self.draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self.active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine.shutdown, 0.0)

    # requests
    def _admit(self, num_seqs: int, tokens: int, view: EngineView | None) -> ErrorInfo | None:
        """None, or why the request is refused; `view`: the engine now (None: no TTFT SLO)."""
        if self.draining:
            return errors.engine_unavailable(f"model {self.spec.name!r}: this replica is shutting down")
        try:
            self.check_health()
        except Exception as exc:  # noqa: BLE001
            return errors.engine_unavailable(f"model {self.spec.name!r}: {exc}")
        if num_seqs > self.capacity:
            return ErrorInfo(400, "invalid_request_error",
                             f"n: the request asks for {num_seqs} sequences (prompts x n) but a replica admits "
                             f"at most {self.capacity}", "n", "invalid_value")
        if self.admitted + num_seqs > self.capacity:
            return errors.overloaded(self.spec.name, self.spec.retry_after_s)
        if view is None:
            return None
        if not self.ttft_admission.admits(num_seqs, tokens, view):
            wait = self.ttft_admission.predicted_wait_s(num_seqs, tokens, view)
            return errors.overloaded(self.spec.name, self.spec.retry_after_s,
                                     f"{view.waiting} sequences ({view.tokens_ahead} prompt tokens) wait for "
                                     f"{view.running} running ones, so its first token would come past the "
                                     f"{self.spec.ttft_slo_ms:g} ms TTFT SLO (~{wait * 1000:.0f} ms before "
                                     "the tail correction)")
        return None

    def _engine_view(self) -> EngineView:
        """The engine's queue now, for TTFT admission (which takes the engine's new steps first)."""
        core = self.engine.engine
        self.ttft_admission.observe_steps(tuple(core.step_log))
        st = self.engine.stats()
        running, waiting = int(st["num_running"]), int(st["num_waiting"] + st.get("num_inbox", 0))
        # the engine's queue is first come, first served: the queued sequences are the last `waiting`
        # of the admitted requests without a first token
        tokens_ahead, left, oldest = 0, waiting, None
        for w in reversed(self._awaiting_first.values()):
            if left <= 0:
                break
            take = min(left, w.num_seqs)
            tokens_ahead += w.tokens * take // w.num_seqs
            left -= take
            oldest = w.t0
        queued_for = 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)
        return EngineView(running, waiting, tokens_ahead, core.step_in_flight, queued_for)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Chunks of one request; the last has finished=True (and an error, or usage)."""
        t0 = time.monotonic()
        n = req.params.n
        num_seqs = len(req.prompts) * n
        tokens = sum(len(p) for p in req.prompts) * n
        view = self._engine_view() if self.ttft_admission.slo_s is not None else None
        err = self._admit(num_seqs, tokens, view)
        if err is not None:
            self.metrics.rejected("overloaded" if err.status == 429 else
                                  "invalid" if err.status < 500 else "unavailable")
            yield GenerateChunk(error=err, finished=True)
            return
        self.admitted += num_seqs
        self.active_requests += 1
        predicted = 0.0
        if view is not None:
            predicted = self.ttft_admission.predicted_wait_s(num_seqs, tokens, view)
            if self._watcher is None:
                self._watcher = asyncio.ensure_future(self._watch_waiting())
        self._awaiting_first[req.request_id] = _Waiting(t0, num_seqs, tokens, predicted)
        try:
            err, params = self._validate(req)
            if err is not None:
                self.metrics.rejected("invalid")
                yield GenerateChunk(error=err, finished=True)
                return
            self.metrics.prompt_tokens.inc(sum(len(p) for p in req.prompts))
            if req.stream and self.ttft_admission.slo_s is None:
                # admitted: the stream opens now; with a TTFT SLO it opens with the first token,
                # since until then the request may still be given up with a 429
                yield GenerateChunk()
            async for chunk in self._stream(req, params, t0):
                yield chunk
        finally:
            self.admitted -= num_seqs
            self.active_requests -= 1
            self._awaiting_first.pop(req.request_id, None)

    def _validate(self, req: GenerateRequest) -> tuple[ErrorInfo | None, list[SamplingParams]]:
        """(None, each prompt's SamplingParams) or (why it is refused, []): all prompts before any starts."""
        try:
            engine = self.engine.engine
            virtual = engine.tasks.get(req.task).num_virtual_tokens if req.task is not None else 0
            params = prompt_params(req, engine.max_model_len, virtual)
            for i, (p, sp) in enumerate(zip(req.prompts, params)):
                try:
                    self.engine.engine.validate(p, sp, req.task)
                except RequestError as exc:  # which of several prompts: prompt[i]
                    if exc.param != "prompt" or len(req.prompts) == 1:
                        raise
                    raise RequestError(f"prompt[{i}]" + str(exc).removeprefix("prompt"), f"prompt[{i}]",
                                       exc.code) from None
        except RequestError as exc:
            if exc.code == "task_not_found":
                return ErrorInfo(404, "invalid_request_error", str(exc), exc.param, exc.code), []
            return ErrorInfo(400, "invalid_request_error", str(exc), exc.param, exc.code or "invalid_value"), []
        return None, params

    def _interval(self) -> float:
        if self.spec.stream_interval_ms > 0:
            return self.spec.stream_interval_ms / 1000.0
        return min(MAX_ADAPTIVE_INTERVAL_S, max(MIN_ADAPTIVE_INTERVAL_S, self.active_requests / ADAPTIVE_CHUNK_RATE))

    async def _stream(self, req: GenerateRequest, params: list[SamplingParams], t0: float
                      ) -> AsyncIterator[GenerateChunk]:
        n, m = req.params.n, self.metrics
        ids = [f"{req.request_id}-{j}" for j in range(len(req.prompts))]
        state = _Progress(len(req.prompts), n)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.request_timeout_s, self._on_timeout, ids, state)
        waiting = self._awaiting_first.get(req.request_id)
        if waiting is not None:
            waiting.give_up = lambda: self._on_late(ids, state)
        pending: GenerateChunk | None = None
        last_sent = 0.0
        try:
            async with contextlib.aclosing(self._outputs(req, params, ids)) as outputs:
                async for j, out in outputs:
                    if state.late:  # given up before its first token: nothing of it is sent
                        break
                    now = time.monotonic()
                    chunk = state.chunk(j, out, now, m)
                    if state.first_token_time is None and state.generated:
                        state.first_token_time = now
                        m.ttft.observe(now - t0)
                        waiting = self._awaiting_first.pop(req.request_id, None)
                        self.ttft_admission.first_token(len(req.prompts) * n,
                                                        0.0 if waiting is None else waiting.predicted, now - t0)
                    if pending is None:
                        pending = chunk
                    else:
                        _merge(pending, chunk)
                    # a non-streaming request gets one chunk, the last
                    if state.done or (req.stream and now - last_sent >= self._interval()):
                        m.generation_tokens.inc(state.generated - state.counted)
                        state.counted = state.generated
                        if state.done:
                            break
                        yield pending
                        pending, last_sent = None, now
        except RequestError as exc:  # raced with a change the pre-validation could not see
            yield GenerateChunk(error=ErrorInfo(400, "invalid_request_error", str(exc), exc.param,
                                                exc.code or "invalid_value"), finished=True)
            return
        except Exception as exc:
            from engines.core.async_engine import EngineDeadError

            if isinstance(exc, EngineDeadError):
                info = errors.engine_unavailable(f"model {self.spec.name!r}: {exc}")
            else:
                log.exception("request %s failed", req.request_id)
                info = errors.internal(f"model {self.spec.name!r}: {type(exc).__name__}: {exc}")
            m.finished("error", state.open_count())
            yield GenerateChunk(error=info, finished=True)
            return
        except (GeneratorExit, asyncio.CancelledError):  # the client left: the engine requests are aborted
            m.finished("abort", state.open_count())
            raise
        finally:
            timer.cancel()
        if state.late:
            m.rejected("ttft_slo")
            yield GenerateChunk(error=errors.ttft_slo_unreachable(self.spec.name, self.spec.retry_after_s,
                                                                  self.spec.ttft_slo_ms), finished=True)
            return
        final = pending or GenerateChunk()
        final.finished = True
        final.usage = (sum(len(p) for p in req.prompts), state.generated)
        final.virtual_tokens = state.virtual_tokens
        m.e2e.observe(time.monotonic() - t0)
        if state.timed_out:
            final.error = errors.timed_out(self.request_timeout_s)
            m.finished("timeout", state.aborted)
        elif state.aborted and self.draining:
            final.error = errors.engine_unavailable(
                f"model {self.spec.name!r}: the server shut down before the request finished")
            m.finished("abort", state.aborted)
        elif state.aborted:
            m.finished("abort", state.aborted)
        for reason, count in state.reasons.items():
            m.finished(reason, count)
        yield final

    async def _outputs(self, req: GenerateRequest, params: list[SamplingParams], ids: list[str]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every engine request of `req`, in arrival order."""
        if len(ids) == 1:  # the common case: no extra task
            async with contextlib.aclosing(self.engine.generate(ids[0], req.prompts[0], params[0],
                                                                task=req.task)) as gen:
                async for out in gen:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(j: int) -> None:
            try:
                async with contextlib.aclosing(self.engine.generate(ids[j], req.prompts[j], params[j],
                                                                    task=req.task)) as gen:
                    async for out in gen:
                        queue.put_nowait((j, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((j, exc))
            queue.put_nowait((j, None))

        tasks = [asyncio.ensure_future(pump(j)) for j in range(len(ids))]
        try:
            remaining = len(ids)
            while remaining:
                j, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield j, item
        finally:
            for t in tasks:
                t.cancel()  # aborts the engine requests still running
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_timeout(self, ids: list[str], state: _Progress) -> None:
        state.timed_out = True
        for rid in ids:
            asyncio.ensure_future(self.engine.abort(rid))

    def _on_late(self, ids: list[str], state: _Progress) -> None:
        state.late = True
        for rid in ids:
            asyncio.ensure_future(self.engine.abort(rid))

    async def _watch_waiting(self) -> None:
        """While requests wait for a first token under a TTFT SLO: give up those that can no longer
        make it (serving/admission.py). The engine's queue is first come, first served, so of the
        requests without a first token (in admission order) the last `waiting` sequences are the
        queued ones and the others are scheduled already."""
        adm = self.ttft_admission
        try:
            while self._awaiting_first and not self.draining:
                view = self._engine_view()
                running, waiting = view.running, view.waiting
                scheduled = sum(w.num_seqs for w in self._awaiting_first.values()) - waiting
                now, ahead = time.monotonic(), 0
                for rid, w in list(self._awaiting_first.items()):
                    position = None if ahead + w.num_seqs <= scheduled else max(0, ahead - scheduled)
                    if w.give_up is not None and adm.late(now - w.t0, position, w.num_seqs, running):
                        adm.given_up(w.predicted, now - w.t0 + adm.remaining_s(position, w.num_seqs, running))
                        del self._awaiting_first[rid]
                        w.give_up()
                        continue
                    ahead += w.num_seqs
                await asyncio.sleep(WATCH_INTERVAL_S)
        finally:
            self._watcher = None


class _Waiting:
    """An admitted request with no first token yet (TTFT admission's bookkeeping)."""

    __slots__ = ("give_up", "num_seqs", "predicted", "t0", "tokens")

    def __init__(self, t0: float, num_seqs: int, tokens: int, predicted: float):
        self.t0, self.num_seqs, self.tokens, self.predicted = t0, num_seqs, tokens, predicted
        """Arrival (monotonic s), sequences, their prompt tokens, and the wait predicted at the door (s)."""
        self.give_up: Callable[[], None] | None = None
        """Set once its engine requests exist: aborts them and answers 429."""


class _Progress:
    """Bookkeeping of one request's completions while it streams."""

    def __init__(self, num_prompts: int, n: int):
        self.virtual: dict[int, int] = {}
        """Virtual tokens of each prompt's task (p-tuning)."""
        self.n = n
        self.open = num_prompts * n
        self.finished_idx: set[int] = set()
        self.plp_sent: set[int] = set()
        self.last_token: dict[int, float] = {}
        self.generated = 0
        self.counted = 0
        self.aborted = 0
        self.reasons: dict[str, int] = {}
        self.first_token_time: float | None = None
        self.timed_out = False
        self.late = False
        """Given up before a first token (TTFT SLO): answered 429, nothing else sent."""

    @property
    def virtual_tokens(self) -> int:
        return sum(self.virtual.values())

    @property
    def done(self) -> bool:
        return self.open == 0

    def open_count(self) -> int:
        return self.open

    def chunk(self, j: int, out: RequestOutput, now: float, m: ReplicaMetrics) -> GenerateChunk:
        self.virtual[j] = out.num_virtual_tokens
        deltas = []
        new_tokens = False
        for c in out.outputs:
            idx = j * self.n + c.index
            if idx in self.finished_idx:
                continue
            if c.token_ids_delta:
                new_tokens = True
                self.generated += len(c.token_ids_delta)
            if c.finish_reason is not None:
                self.finished_idx.add(idx)
                self.open -= 1
                if c.finish_reason == "abort":
                    self.aborted += 1
                else:
                    self.reasons[c.finish_reason] = self.reasons.get(c.finish_reason, 0) + 1
            if c.token_ids_delta or c.text_delta or c.finish_reason is not None:
                deltas.append(Delta(idx, c.text_delta, c.token_ids_delta, c.logprobs_delta, c.finish_reason,
                                    c.stop_reason))
        if new_tokens:
            prev = self.last_token.get(j)
            if prev is not None:
                m.itl.observe(now - prev)
            self.last_token[j] = now
        chunk = GenerateChunk(deltas=deltas)
        if out.prompt_logprobs is not None and j not in self.plp_sent:
            self.plp_sent.add(j)
            chunk.prompt_logprobs = {j: out.prompt_logprobs}
        if out.finished:
            t = out.metrics
            if "first_scheduled_time" in t and "arrival_time" in t:
                m.queue.observe(max(0.0, t["first_scheduled_time"] - t["arrival_time"]))
        return chunk


def _merge(into: GenerateChunk, new: GenerateChunk) -> None:
    """Append `new`'s deltas to `into` (both of the same request, `new` later)."""
    by_idx = {d.index: d for d in into.deltas}
    for d in new.deltas:
        old = by_idx.get(d.index)
        if old is None:
            into.deltas.append(d)
            by_idx[d.index] = d
            continue
        old.text += d.text
        old.token_ids = old.token_ids + d.token_ids
        old.logprobs = old.logprobs + d.logprobs
        if d.finish_reason is not None:
            old.finish_reason, old.stop_reason = d.finish_reason, d.stop_reason
    if new.prompt_logprobs:
        into.prompt_logprobs = {**(into.prompt_logprobs or {}), **new.prompt_logprobs}
