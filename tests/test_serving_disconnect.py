"""serving/disconnect.py over real HTTP (uvicorn on 127.0.0.1): work awaited by a non-streaming
route is cancelled when its client closes the connection, and finishes normally otherwise."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_serving_faults import uvicorn_thread

from serving.disconnect import unless_disconnected
from serving.errors import APIError


def _app(events: dict[str, threading.Event], statuses: list[int]) -> Starlette:
    async def work(seconds: float) -> str:
        events["started"].set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            events["cancelled"].set()
            raise
        return "done"

    async def route(request: Request) -> JSONResponse:
        await request.body()
        try:
            result = await unless_disconnected(request, work(float(request.query_params["s"])))
        except APIError as exc:
            statuses.append(exc.info.status)
            raise
        return JSONResponse({"result": result})

    return Starlette(routes=[Route("/work", route, methods=["POST"])])


def test_work_is_cancelled_when_the_client_leaves_and_finishes_when_it_stays():
    events = {"started": threading.Event(), "cancelled": threading.Event()}
    statuses: list[int] = []
    with (uvicorn_thread(_app(events, statuses), log_level="critical") as (url, _),
          httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.5)) as c):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            c.post("/work?s=30", json={})
        assert events["started"].is_set()
        assert events["cancelled"].wait(5), "the work went on after its client left"
        deadline = time.monotonic() + 5  # the route answers once the cancelled work has unwound
        while not statuses and time.monotonic() < deadline:
            time.sleep(0.01)
        assert statuses == [499]
        events["cancelled"].clear()
        r = c.post("/work?s=0.05", json={})
        assert r.status_code == 200 and r.json() == {"result": "done"}
        assert not events["cancelled"].is_set()
