"""P-tuning admin routes (an admin key is required whenever any API keys are configured).

    POST   /v1/ptuning/jobs          {model, task, data | dataset_path, recipe}  -> 202, the job
    GET    /v1/ptuning/jobs[/{id}]   state, progress {step, total, loss, elapsed_s, eta_s}, metrics
    DELETE /v1/ptuning/jobs/{id}     cancel
    GET    /v1/ptuning/tasks[?model=]
    POST   /v1/ptuning/tasks         {model, name, path}: load a PEFT adapter folder
    DELETE /v1/ptuning/tasks/{name}?model=

Each route sends one typed operation (serving/ptuning_ops.py) to a replica of the model, which runs
it (serving/ptuning_admin.py); the model's ptuning/ folder carries every change to the other
replicas and across restarts.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from serving import errors
from serving.auth import require_admin
from serving.errors import APIError
from serving.gateway import ServedModel, gateway_of, read_json
from serving.ptuning_ops import (
    AddTask,
    CancelJob,
    DeleteTask,
    GetJob,
    ListJobs,
    ListTasks,
    PtuningOp,
    StartJob,
)

router = APIRouter(dependencies=[Depends(require_admin)])


async def _call(model: ServedModel, op: PtuningOp) -> Any:
    err, result = await model.backend.ptuning_admin(op)
    if err is not None:
        raise APIError(err)
    return result


async def _model(request: Request, name: Any) -> ServedModel:
    gw = gateway_of(request)
    if name is None and len(gw.names) == 1:
        name = gw.names[0]
    if name is None:
        raise errors.invalid(f"model: required (served: {', '.join(gw.names)})", "model", "missing_required_parameter")
    return await gw.model(name)


def _only(body: dict, allowed: set[str]) -> None:
    unknown = set(body) - allowed
    if unknown:
        raise errors.invalid(f"Unrecognized request argument supplied: {', '.join(sorted(unknown))}", min(unknown),
                             "unknown_parameter")


@router.post("/v1/ptuning/jobs")
async def create_job(request: Request) -> JSONResponse:
    body = await read_json(request, gateway_of(request))
    _only(body, {"model", "task", "data", "dataset_path", "recipe"})
    model = await _model(request, body.get("model"))
    job = await _call(model, StartJob(task=body.get("task"), data=body.get("data"),
                                      dataset_path=body.get("dataset_path"), recipe=body.get("recipe")))
    return JSONResponse(job, status_code=202)


async def _find_job(request: Request, job_id: str) -> tuple[ServedModel, dict]:
    gw = gateway_of(request)
    for name in gw.names:
        model = await gw.model(name)
        err, job = await model.backend.ptuning_admin(GetJob(job_id))
        if err is None:
            return model, job
    raise errors.not_found(f"job {job_id!r} does not exist", "job_not_found", "id")


@router.get("/v1/ptuning/jobs")
async def list_jobs(request: Request, model: str | None = None) -> JSONResponse:
    gw = gateway_of(request)
    names = [model] if model is not None else gw.names
    data = [j for n in names for j in await _call(await gw.model(n), ListJobs())]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/ptuning/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> JSONResponse:
    return JSONResponse((await _find_job(request, job_id))[1])


@router.delete("/v1/ptuning/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> JSONResponse:
    model, _ = await _find_job(request, job_id)
    return JSONResponse(await _call(model, CancelJob(job_id)))


@router.get("/v1/ptuning/tasks")
async def list_tasks(request: Request, model: str | None = None) -> JSONResponse:
    gw = gateway_of(request)
    names = [model] if model is not None else gw.names
    data = [t for n in names for t in await _call(await gw.model(n), ListTasks())]
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/ptuning/tasks")
async def add_task(request: Request) -> JSONResponse:
    body = await read_json(request, gateway_of(request))
    _only(body, {"model", "name", "path"})
    model = await _model(request, body.get("model"))
    return JSONResponse(await _call(model, AddTask(body.get("name"), body.get("path"))), status_code=201)


@router.delete("/v1/ptuning/tasks/{name}")
async def delete_task(name: str, request: Request, model: str | None = None) -> JSONResponse:
    served = await _model(request, model)
    return JSONResponse(await _call(served, DeleteTask(name)))
