"""How the gateway reaches a model: in-process, or through a Ray Serve DeploymentHandle.

Both implement the same three calls (`info`, `generate`, `ready`) over the wire types of
serving/wire.py, so the gateway app is identical in tests (in-process, no Ray) and in production.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from serving import errors
from serving.wire import ErrorInfo, GenerateChunk, GenerateRequest, ModelInfo

if TYPE_CHECKING:
    from serving.model_core import ModelCore
    from serving.ptuning_ops import PtuningOp

log = logging.getLogger("shardserve.gateway")


class ModelBackend(Protocol):
    async def info(self) -> ModelInfo: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Chunks of the request; the first may be an error, the last has finished=True."""
        ...

    async def ready(self) -> bool: ...


class LocalBackend:
    """The model's engine runs in this process (tests, single-process tools)."""

    def __init__(self, core: ModelCore):
        self.core = core

    async def info(self) -> ModelInfo:
        return self.core.info

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return self.core.generate(req)

    async def ptuning_admin(self, op: PtuningOp) -> tuple[ErrorInfo | None, Any]:
        return await self.core.ptuning_admin(op)

    async def step_windows(self) -> list[dict]:
        return [self.core.step_window()]

    async def ready(self) -> bool:
        return self.core.ready()


class RayBackend:
    """The model runs in ModelServer replicas of a Ray Serve deployment.

    A replica refuses a request at its admission limit (429) before generating anything. In a
    burst, Ray's router can send one replica more than it admits while another has room (its view
    of their queues lags), so such a refusal is retried, up to `admission_retries` times, and
    reaches the client only when the retries are refused too."""

    def __init__(self, handle: Any, admission_retries: int = 3, step_windows: Any = None):
        self.handle = handle
        self._step_windows = step_windows
        """async () -> every replica's step window, from the metrics hub (serving/deployments.py)."""
        self._stream = handle.options(stream=True, method_name="generate")
        self._info: ModelInfo | None = None
        self.admission_retries = admission_retries

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.handle.info.remote()
        return self._info

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        from ray.serve.exceptions import BackPressureError

        stream = None
        try:
            for attempt in range(self.admission_retries + 1):
                stream = self._stream.remote(req)
                # from our own ModelServer (serving/deployments.py), never a client
                first: GenerateChunk = pickle.loads(await stream.__anext__())
                refused = first.error is not None and first.error.code == "server_overloaded"
                if not refused or attempt == self.admission_retries:
                    break
                stream.cancel()
                await asyncio.sleep(0.005 * (attempt + 1))
            yield first
            async for raw in stream:
                yield pickle.loads(raw)
        except BackPressureError:
            info = await self.info()
            yield GenerateChunk(error=errors.overloaded(info.name, 1), finished=True)
        except Exception as exc:  # noqa: BLE001 - the replica died mid-request, or Ray failed
            log.warning("request %s: model server failed: %r", req.request_id, exc)
            yield GenerateChunk(error=errors.engine_unavailable(
                f"the model server failed while serving the request ({type(exc).__name__}); retry"),
                finished=True)
        finally:
            if stream is not None:
                stream.cancel()  # no-op when finished; otherwise the replica aborts the engine request

    async def ptuning_admin(self, op: PtuningOp) -> tuple[ErrorInfo | None, Any]:
        """On one replica; the others pick task changes up from the model's ptuning/ folder."""
        return await self.handle.ptuning_admin.remote(op)

    async def step_windows(self) -> list[dict]:
        """Every replica's latest published step window (serving/steps_api.py)."""
        return await self._step_windows() if self._step_windows is not None else []

    async def ready(self) -> bool:
        try:
            return bool(await self.handle.ready.remote())
        except Exception:  # noqa: BLE001 - no healthy replica answers
            return False
