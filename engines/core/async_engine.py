"""The async engine the server uses: add a request, iterate its outputs, abort it.

One background thread owns the LLMEngine and runs its step loop; torch releases the GIL inside
its kernels, so the event loop (HTTP, tokenization) keeps running during a step. Requests and
aborts reach the thread through a queue and take effect between steps, so an aborted request's
KV blocks are free within one step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engines.core.config import EngineConfig, kv_bytes_per_block
from engines.core.llm_engine import LLMEngine, Prompt
from engines.core.outputs import RequestOutput
from engines.core.sampling_params import RequestError, SamplingParams
from engines.cpu.cpu_threads import release_openmp_pool

log = logging.getLogger(__name__)

PREFAULT_PIECE, PREFAULT_AHEAD = 8 << 20, 512 << 20
"""Bytes of KV cache the idle loop maps between two looks at its inbox, and how far above the blocks used so far
it keeps the cache mapped (KVCache.prefault): a burst's steps then write to mapped pages instead of faulting them
in (~1.2-2 s a GiB on a 2-core EPYC VM; the first repetition of the SmolLM2 bf16 offline mix on fresh blocks 447
against 488 tok/s on the same blocks again), a request arriving meanwhile waits at most one piece, and an engine
whose cache was sized from the host's memory still holds only what it used plus PREFAULT_AHEAD (or twice the most
that one busy period took, where that is more: the next burst takes fresh blocks above the cached ones)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served by this engine any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque[tuple[str, tuple]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        # idle, the loop maps the KV cache's pages up to PREFAULT_AHEAD above the blocks used so far (KVCache.prefault)
        # (or what max_num_seqs sequences of the longest length hold, where that is less: a small model's test server)
        per_block = kv_bytes_per_block(engine.executor.model_config, engine.config)
        longest = engine.config.max_num_seqs * -(-engine.max_model_len // engine.config.block_size)
        self._ahead_blocks = max(1, min(PREFAULT_AHEAD // per_block, longest))
        # blocks [0, _mapped_to) mapped (or as far as the host could): all of a cache the user sized (LLMEngine)
        self._mapped_to = engine.executor.num_blocks if engine.cache_mapped else 0
        self._busy_from: int | None = None  # high_water when the current busy period began
        self.dead: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, engine_config: EngineConfig | None = None,
                       **kwargs) -> AsyncLLMEngine:
        engine = LLMEngine(model_dir, engine_config, **kwargs)
        # every step runs on the loop thread: the OpenMP team this thread's load used would only slow them
        release_openmp_pool()
        return cls(engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> dict[str, float]:
        """The engine's counters, plus `num_inbox`: adds and aborts handed to the loop that it has not
        taken yet (requests about to join num_waiting)."""
        return {**self.engine.stats(), "num_inbox": len(self._inbox)}

    def check_health(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"engine loop failed: {self.dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        try:  # a shard that died while the engine was idle
            self.engine.executor.check_health()
        except Exception as exc:  # any executor failure makes the engine unusable
            raise EngineDeadError(f"executor unhealthy: {exc}") from exc

    # requests
    def validate(self, prompt: Prompt, params: SamplingParams, task: str | None = None):
        """Check a request without queueing it (raises RequestError); thread-safe."""
        return self.engine.validate(prompt, params, task)

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                       task: str | None = None) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request (each carries this step's deltas).

        Raises RequestError before the first output for invalid input, EngineDeadError when the
        engine fails. Leaving the iteration early (client gone, timeout) aborts the request.
        """
        self.check_health()
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        params = params or SamplingParams(**self.engine.sampling_defaults)  # generation_config.json defaults
        validated = self.engine.validate(prompt, params, task)
        if request_id in self._streams:
            raise RequestError(f"request_id: {request_id!r} is already running", param="request_id")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        if self.dead is not None:  # died while we registered
            self._streams.pop(request_id, None)
            self.check_health()
        self._inbox.append(("add", (request_id, prompt, params, validated, task)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.append(("abort", (request_id, None)))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its KV blocks are back in the pool."""
        done = asyncio.get_running_loop().create_future()
        self._inbox.append(("abort", (request_id, _Stream(asyncio.get_running_loop(), done))))
        self._wake.set()
        await done

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to drain_timeout s, abort the rest."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self.dead is None:
            time.sleep(0.02)
        for rid in list(self._streams):
            self._inbox.append(("abort", (rid, None)))
        self._inbox.append(("stop", ()))
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # the loop thread
    def _drain_inbox(self) -> bool:
        while self._inbox:
            kind, args = self._inbox.popleft()
            if kind == "stop":
                return False
            if kind == "add":
                rid, prompt, params, validated, task = args
                try:
                    self.engine.add_request(rid, prompt, params, validated=validated, task=task)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    self._send(rid, exc, final=True)
            elif kind == "abort":
                rid, waiter = args
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._send(rid, out, final=True)
                if waiter is not None:
                    waiter.loop.call_soon_threadsafe(
                        lambda f=waiter.queue: f.done() or f.set_result(None))
        return True

    def _send(self, rid: str, item, final: bool = False) -> None:
        stream = self._streams.pop(rid, None) if final else self._streams.get(rid)
        if stream is not None:
            stream.put(item)

    def _send_step(self, outputs) -> None:
        """A step's outputs to their streams: one hand-off to each consumer loop (all of them, in a server), not one
        a stream: each call_soon_threadsafe wakes the loop through its self-pipe (a syscall) and takes the GIL, 64
        times a step with 64 streams. (SmolLM2 bf16 mix, 64 streams in one process, 2-core Xeon: 567 -> 607 tok/s
        in one pair, later 593 vs 587 over three pairs: within the host's noise, never slower.)"""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumers' loop is closed: nobody is listening
                pass

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_inbox():
                    return
                high = self.engine.scheduler.blocks.high_water
                if not self.engine.has_unfinished_requests():
                    if self._busy_from is not None:  # a busy period ended: map ahead at least twice what it took
                        # (prefix caching keeps finished requests' blocks, so the next burst takes fresh ones above
                        # them: the SmolLM2 fp32 HTTP mix took ~800 MB a burst, over PREFAULT_AHEAD, and its next
                        # burst's KV writes faulted, 4 % of its step time in clear_page)
                        self._ahead_blocks = max(self._ahead_blocks, 2 * (high - self._busy_from))
                        self._busy_from = None
                    # never past the pool: a window wider than what is left (a small cache, a burst that took most
                    # of it) would otherwise never be reached, and the loop would spin on prefault while idle
                    want = min(high + self._ahead_blocks, self.engine.executor.num_blocks)
                    if want > self._mapped_to and not self._wake.is_set():  # idle: map KV pages ahead of use
                        mapped = self.engine.executor.prefault(PREFAULT_PIECE, want)
                        self.engine.scheduler.blocks.mapped = mapped  # new runs prefer mapped blocks
                        if mapped >= want:
                            self._mapped_to = want
                        continue
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if self._busy_from is None:
                    self._busy_from = high
                outputs = self.engine.step()
                self.last_step_time = time.monotonic()
                self._send_step(outputs)
        except BaseException as exc:  # the engine is dead: fail everyone clearly
            log.exception("engine loop failed")
            self.dead = exc
            message = f"engine failed: {type(exc).__name__}: {exc}"
            try:
                self.engine.fail_all(message)
            except Exception:  # noqa: BLE001
                pass
            for rid in list(self._streams):
                self._send(rid, EngineDeadError(message), final=True)
