"""Stop work whose client has gone: a non-streaming response is assembled whole before any byte is
sent, so nothing notices a closed connection while it is awaited (a streaming response notices at
its next send, and Starlette listens for the disconnect beside it). Without this, a client that
gives up leaves its request generating, holding a batch slot and KV blocks, until it finishes or
reaches the server's request timeout.

    result = await unless_disconnected(request, generate_whole_response())

Cancelling the awaited task raises CancelledError at its current await; when that is a
generation stream's `__anext__` (the stream of Gateway.open), the cancel reaches the model
server's generator, which aborts its engine requests (serving/model_core.py), in-process or over
Ray (RayBackend cancels the replica's stream in its `finally`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from serving.errors import APIError
from serving.wire import ErrorInfo

T = TypeVar("T")

CLIENT_CLOSED = 499
"""nginx's "client closed request": the status the access log and metrics record; the client
never sees it (the connection is gone)."""


def client_gone() -> APIError:
    return APIError(ErrorInfo(CLIENT_CLOSED, "invalid_request_error",
                              "the client closed the connection before the response was ready", None,
                              "client_disconnected"))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects. Body messages (none are left once the route has read
    the body) are skipped, so call it only after reading the body."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """`aw`'s result, unless the client of `request` disconnects first: then `aw` is cancelled
    (and awaited, so its cleanup, e.g. aborting the engine request, has run) and an APIError with
    status 499, code "client_disconnected", is raised for the access log and metrics.

    Use it in non-streaming routes, after the request body has been read: the watcher consumes
    ASGI receive messages. If `aw` raises, its exception propagates unchanged; if the caller is
    cancelled, `aw` is cancelled too.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # a result that raced a disconnect is still returned: the work is done
            return task.result()
        raise client_gone()
    finally:
        for t in (watcher, task):  # cancelled and awaited: their cleanup has run when this returns
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
