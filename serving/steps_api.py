"""The engine's recent steps, per replica (an admin key is required whenever any keys are configured).

    GET /v1/admin/steps?model=NAME[&limit=N]

One entry per replica of the model: its layout (TP x PP, threads, batch limits) and its latest
working steps, oldest first (at most `limit`, at most what the engine keeps: the model's
engine.step_record_len, 256 unless the deployment config says otherwise): each step's
wall seconds, the gap before it (the loop's time since the previous step while requests were
unfinished; null when the engine may have idled), its decode sequences and their context tokens,
its prefill sequences, tokens and attention pairs, and the sequences it sampled. `shardserve tune
profile` fits the served step time on these. Behind Ray Serve each replica publishes its window
with its metrics (server.metrics_push_interval_s is the staleness bound).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engines.core.step_record import STEP_FIELDS
from serving import errors
from serving.auth import require_admin
from serving.gateway import gateway_of

router = APIRouter(dependencies=[Depends(require_admin)])


def as_route(window: dict[str, Any], limit: int) -> dict[str, Any]:
    """A published window as the route returns it: its latest `limit` steps as dicts, gap_s None
    where the engine may have idled."""
    steps = [dict(zip(STEP_FIELDS, s, strict=True)) for s in window["rows"][-limit:]]
    for s in steps:
        if s["gap_s"] < 0:
            s["gap_s"] = None
    return {**{k: v for k, v in window.items() if k != "rows"}, "steps": steps}


def _count(text: str) -> int:
    """An ASCII decimal count, else 0 (refused by the range check): str.isdigit() also holds for "²",
    which int() refuses, and int() refuses more than 4300 digits."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else 0


@router.get("/v1/admin/steps")
async def steps(request: Request, model: str | None = None, limit: str | None = None) -> JSONResponse:
    gw = gateway_of(request)
    if model is None and len(gw.names) == 1:
        model = gw.names[0]
    if model is None:
        raise errors.invalid(f"model: required (served: {', '.join(gw.names)})", "model", "missing_required_parameter")
    served = await gw.model(model)
    most = served.info.step_record_len  # what each replica's engine keeps (EngineConfig.step_record_len)
    n = most if limit is None else _count(limit)
    if not 1 <= n <= most:
        raise errors.invalid(f"limit: must be an integer in [1, {most}], got {limit!r}", "limit")
    windows = [as_route(w, n) for w in await served.backend.step_windows()]
    return JSONResponse({"object": "list", "model": model, "data": sorted(windows, key=lambda w: w["replica"])})
