"""KServe v2 / Triton inference protocol: health, metadata, infer, and the generate extension.

`/infer` takes a BYTES tensor `text_input` (shape [B] or [B, 1]: B prompts) and returns a BYTES
tensor `text_output` of the same shape. Generation parameters come as one-element input tensors
(`max_tokens` INT32, `temperature` FP32, ...) or in the request's `parameters`. Tensors may be
JSON or use Triton's binary tensor extension (serving/kserve_tensors.py), so `tritonclient.http`
works with its defaults. Errors have the v2 body, `{"error": "<message>"}` (serving/app.py), and
name the field as this request sent it (`inputs[max_tokens]`, `parameters.top_k`, `text_input`),
never the OpenAI or engine field behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from engines.core.sampling_params import SamplingParams
from serving import errors
from serving.disconnect import unless_disconnected
from serving.errors import APIError
from serving.gateway import (
    Gateway,
    ServedModel,
    check_json_content_type,
    decode_json,
    gateway_of,
    new_request_id,
    read_body,
    sampling_params,
)
from serving.kserve_tensors import (
    or_empty,
    scalar,
    split_binary,
    tensor_values,
)
from serving.openai_api import SSE_HEADERS, _chunks
from serving.protocol import INT32_MAX, SEED_MAX, SEED_MIN, _Body, parse
from serving.wire import ErrorInfo, GenerateChunk, GenerateRequest

router = APIRouter()
VERSION = "1"
TRITON_RESERVED = {"binary_data_output", "sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                   "headers"}


V2_MAX_TOKENS = 16
"""A v2 request's max_tokens when neither it nor generation_config.json sets one."""


class GenerateParams(_Body):
    """Generation parameters of the v2 routes (a subset of the OpenAI ones, same ranges)."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None

    def to_sampling(self, defaults: dict[str, Any]) -> SamplingParams:
        """The fields the request left unset (or null) take the model's generation_config.json values,
        as /v1 does, so one model samples alike on both APIs; but max_tokens stays unset, for
        Gateway.open to resolve (default_max_tokens) within server.limits.max_tokens."""
        kw = {k: v for k, v in self.model_dump().items() if v is not None}
        if isinstance(kw.get("stop"), list):
            kw["stop"] = tuple(kw["stop"])
        return sampling_params(defaults, **{"max_tokens": None, **kw})


def default_max_tokens(m: ServedModel) -> int:
    """A v2 request's length when it sets none: generation_config.json's max_new_tokens, else 16."""
    return m.info.sampling_defaults.get("max_tokens", V2_MAX_TOKENS)


# error names: engine and limit errors name SamplingParams / OpenAI fields (prompt, n, max_tokens)
_HEAD = re.compile(r"^([A-Za-z_]\w*)(.*)$", re.DOTALL)


def _field_names(text: str, sent: dict[str, str], unset: str) -> dict[str, str]:
    """Engine / limit field -> the field of this v2 request that carries it. `sent`: what the request
    set, by where it set it; `unset` ("parameters.{}" or "{}"): where a field it did not set goes.
    The prompts and their count (n is always 1 here: one sequence per prompt) are `text`."""
    names = {k: unset.format(k) for k in GenerateParams.model_fields}
    return {**names, "task": "parameters.task", **sent, "prompt": text, "n": text}


def _renamed(info: ErrorInfo, names: dict[str, str]) -> ErrorInfo:
    """`info` with its param, and the message's mention of it, in this request's own field names."""
    m = _HEAD.match(info.param or "")
    if m is None or m.group(1) not in names or names[m.group(1)] == m.group(1):
        return info
    old, new = info.param, names[m.group(1)] + m.group(2)
    msg = info.message
    if msg.startswith(f"{old}: "):
        msg = f"{new}: {msg[len(old) + 2:]}"
    elif f"'{old}'" in msg:
        msg = msg.replace(f"'{old}'", f"'{new}'")
    else:
        msg = f"{new}: {msg}"
    if m.group(1) == "n":
        msg = msg.replace(" (prompts x n)", f" (one per element of {new})")
    return dataclasses.replace(info, param=new, message=msg)


@contextlib.contextmanager
def _named(names: dict[str, str]) -> Iterator[None]:
    try:
        yield
    except APIError as exc:
        raise APIError(_renamed(exc.info, names)) from None


def _metadata(m: str) -> dict:
    return {"name": m, "versions": [VERSION], "platform": "shardserve",
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1]},
                       {"name": "temperature", "datatype": "FP32", "shape": [1]},
                       {"name": "top_p", "datatype": "FP32", "shape": [1]},
                       {"name": "top_k", "datatype": "INT32", "shape": [1]},
                       {"name": "seed", "datatype": "INT64", "shape": [1]},
                       {"name": "stop", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}


async def _model(request: Request, name: str, version: str | None) -> ServedModel:
    if version is not None and version not in ("", VERSION):
        raise errors.not_found(f"model {name!r} has no version {version!r}; versions: [{VERSION}]",
                               "model_version_not_found")
    m = await gateway_of(request).model(name)
    request.state.model = m.name
    return m


@router.get("/v2")
async def server_metadata() -> JSONResponse:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("shardserve")
    except PackageNotFoundError:
        v = "0"
    return JSONResponse({"name": "shardserve", "version": v, "extensions": ["generate", "binary_tensor_data"]})


@router.get("/v2/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    gw = gateway_of(request)
    for name in gw.names:
        if not await gw.backends[name].ready():
            info = errors.engine_unavailable(f"model {name!r} is not ready")  # /health shares this route
            return JSONResponse(errors.body_for(info, request.url.path), status_code=503)
    return Response(status_code=200)


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(name: str, request: Request, version: str | None = None) -> JSONResponse:
    m = await _model(request, name, version)
    return JSONResponse(_metadata(m.name))


@router.get("/v2/models/{name}/config")
@router.get("/v2/models/{name}/versions/{version}/config")
async def model_config(name: str, request: Request, version: str | None = None) -> JSONResponse:
    m = await _model(request, name, version)
    meta = _metadata(m.name)
    return JSONResponse({"name": m.name, "platform": "shardserve", "backend": "shardserve", "max_batch_size": 0,
                         "input": [{"name": i["name"], "data_type": "TYPE_" + ("STRING" if i["datatype"] == "BYTES"
                                                                               else i["datatype"]),
                                    "dims": i["shape"], "optional": i["name"] != "text_input"}
                                   for i in meta["inputs"]],
                         "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
                         "model_transaction_policy": {"decoupled": True},
                         "max_model_len": m.info.max_model_len})


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(name: str, request: Request, version: str | None = None) -> Response:
    m = await _model(request, name, version)
    if await m.backend.ready():
        return Response(status_code=200)
    return JSONResponse(errors.engine_unavailable(f"model {name!r} is not ready").kserve_body(), status_code=503)


# infer
@router.post("/v2/models/{name}/infer")
@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    gw: Gateway = gateway_of(request)
    m = await _model(request, name, version)
    body, blob = split_binary(request, await read_body(request, gw.options.max_body_bytes))
    unknown = set(body) - {"id", "inputs", "outputs", "parameters"}
    if unknown:
        raise errors.invalid(f"Unrecognized request argument supplied: {', '.join(sorted(unknown))}",
                             min(unknown), "unknown_parameter")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise errors.invalid("inputs: must be a non-empty list of tensors", "inputs", "missing_required_parameter")
    req_params = or_empty(body.get("parameters"), {})
    if not isinstance(req_params, dict):
        raise errors.invalid("parameters: must be an object", "parameters", "invalid_type")
    gen_values = {k: v for k, v in req_params.items() if k not in TRITON_RESERVED}
    sent = {k: f"parameters.{k}" for k in gen_values}
    binary_out = bool(req_params.get("binary_data_output", False))
    texts, shape, offset = None, None, 0
    for i, t in enumerate(inputs):
        tname, values, tshape, offset = tensor_values(t, i, blob, offset)
        if tname in sent or (tname == "text_input" and texts is not None):
            raise errors.invalid(f"inputs[{tname}]: given twice (as {sent.get(tname, 'another input tensor')})",
                                 f"inputs[{tname}]")
        if tname == "text_input":
            if t.get("datatype") != "BYTES":
                raise errors.invalid("inputs[text_input].datatype: must be BYTES", "inputs[text_input].datatype")
            texts, shape = values, tshape
            continue
        if tname == "stop":  # a BYTES tensor of shape [-1]: one stop string per element
            gen_values[tname] = list(values)
        elif tname in GenerateParams.model_fields:
            gen_values[tname] = scalar(tname, values)  # typed by its datatype (kserve_tensors._check_typed)
        elif tname == "stream":
            if scalar(tname, values):
                raise errors.invalid("inputs[stream]: /infer does not stream; use /generate_stream", "inputs[stream]")
            continue
        else:
            raise errors.invalid(f"inputs[{tname}]: unknown input; known: text_input, "
                                 f"{', '.join(GenerateParams.model_fields)}", f"inputs[{tname}]", "unknown_parameter")
        sent[tname] = f"inputs[{tname}]"
    if texts is None:
        raise errors.invalid("inputs: a BYTES tensor named text_input is required", "inputs[text_input]",
                             "missing_required_parameter")
    if not texts:
        raise errors.invalid("inputs[text_input]: holds no prompt", "inputs[text_input]")
    outputs = or_empty(body.get("outputs"), [])
    if not isinstance(outputs, list):
        raise errors.invalid("outputs: must be a list of requested outputs", "outputs", "invalid_type")
    for o in outputs:
        if not isinstance(o, dict) or o.get("name") != "text_output":
            raise errors.invalid("outputs: the only output is text_output", "outputs")
        if not isinstance(or_empty(o.get("parameters"), {}), dict):
            raise errors.invalid("outputs[text_output].parameters: must be an object",
                                 "outputs[text_output].parameters", "invalid_type")
        if (o.get("parameters") or {}).get("binary_data"):
            binary_out = True
    names = _field_names("inputs[text_input]", sent, "parameters.{}")
    with _named(names):
        task = _task(gen_values)
        params = parse(GenerateParams, gen_values).to_sampling(m.info.sampling_defaults)
        ids = [m.encode(text, "inputs[text_input]") for text in texts]
        req = GenerateRequest(new_request_id(), ids, params, task=task)
        texts_out = await unless_disconnected(request, _collect(request, gw, m, req))
    out = [""] * len(ids)
    for index, text, _ in texts_out:
        out[index] = text
    head: dict[str, Any] = {"model_name": m.name, "model_version": VERSION}
    if isinstance(body.get("id"), str):
        head["id"] = body["id"]
    tensor = {"name": "text_output", "datatype": "BYTES", "shape": shape}
    if not binary_out:
        head["outputs"] = [{**tensor, "data": out}]
        return JSONResponse(head)
    raw = b"".join(struct.pack("<I", len(b)) + b for b in (s.encode() for s in out))
    head["outputs"] = [{**tensor, "parameters": {"binary_data_size": len(raw)}}]
    header = json.dumps(head).encode()
    return Response(header + raw, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})


async def _collect(request: Request, gw: Gateway, m: ServedModel, req: GenerateRequest
                   ) -> list[tuple[int, str, str | None]]:
    """(completion index, text, finish reason) of each completion, generated whole. Awaited under
    unless_disconnected: a client that leaves cancels it, and closing the stream aborts the engine's
    requests."""
    first, rest = await gw.open(m, req, default_max_tokens(m))
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                raise APIError(chunk.error)
            for d in chunk.deltas:
                text[d.index] = text.get(d.index, "") + d.text
                finish[d.index] = d.finish_reason or finish.get(d.index)
            if chunk.usage is not None:
                request.state.prompt_tokens, request.state.completion_tokens = chunk.usage
    finally:
        await rest.aclose()
    return [(i, text[i], finish.get(i)) for i in sorted(text)]


# the generate extension
async def _generate_request(request: Request, m: ServedModel, stream: bool
                            ) -> tuple[GenerateRequest, dict, dict[str, str]]:
    """(the request, its JSON body, its field names for errors: _field_names)."""
    gw = gateway_of(request)
    check_json_content_type(request)
    body = decode_json(await read_body(request, gw.options.max_body_bytes))
    text = body.get("text_input")
    if not isinstance(text, str) or not text:
        raise errors.invalid("text_input: required, a non-empty string", "text_input",
                             "missing_required_parameter" if text is None else "invalid_value")
    values = {k: v for k, v in body.items() if k not in ("text_input", "parameters", "id", "stream")}
    nested = or_empty(body.get("parameters"), {})  # null: none; false or 0 are not an object
    if not isinstance(nested, dict):
        raise errors.invalid("parameters: must be an object", "parameters", "invalid_type")
    both = set(values) & set(nested)
    if both:
        raise errors.invalid(f"{min(both)}: given both at the top level and in parameters", min(both))
    sent = {k: k for k in values}
    nested = {k: v for k, v in nested.items() if k not in TRITON_RESERVED and k != "stream"}
    sent.update({k: f"parameters.{k}" for k in nested})
    values.update(nested)
    names = _field_names("text_input", sent, "{}")
    with _named(names):
        task = _task(values)
        params = parse(GenerateParams, values).to_sampling(m.info.sampling_defaults)
        ids = [m.encode(text, "text_input")]
    return GenerateRequest(new_request_id(), ids, params, task=task, stream=stream), body, names


def _task(values: dict) -> str | None:
    """parameters.task: a p-tuned task (removed from the sampling values)."""
    from engines.transforms.ptuning import TaskError, check_task_name

    task = values.pop("task", None)
    if task is not None:
        try:
            check_task_name(task)
        except TaskError as exc:
            raise errors.invalid(f"parameters.{exc}", "parameters.task", "invalid_task_name") from None
    return task


@router.post("/v2/models/{name}/generate")
@router.post("/v2/models/{name}/versions/{version}/generate")
async def generate(name: str, request: Request, version: str | None = None) -> JSONResponse:
    gw = gateway_of(request)
    m = await _model(request, name, version)
    req, body, names = await _generate_request(request, m, stream=False)
    with _named(names):
        done = await unless_disconnected(request, _collect(request, gw, m, req))
    _, text, finish = done[0] if done else (0, "", None)
    out = {"model_name": m.name, "model_version": VERSION, "text_output": text, "finish_reason": finish}
    if isinstance(body.get("id"), str):
        out["id"] = body["id"]
    return JSONResponse(out)


@router.post("/v2/models/{name}/generate_stream")
@router.post("/v2/models/{name}/versions/{version}/generate_stream")
async def generate_stream(name: str, request: Request, version: str | None = None) -> StreamingResponse:
    gw = gateway_of(request)
    m = await _model(request, name, version)
    request.state.stream = True
    req, body, names = await _generate_request(request, m, stream=True)
    with _named(names):
        first, rest = await gw.open(m, req, default_max_tokens(m))
    base: dict[str, Any] = {"model_name": m.name, "model_version": VERSION}
    if isinstance(body.get("id"), str):
        base["id"] = body["id"]
    return StreamingResponse(_stream(request, base, names, first, rest), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _stream(request: Request, base: dict, names: dict[str, str], first: GenerateChunk,
                  rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                request.state.stream_error = chunk.error.code
                yield f"data: {json.dumps(_renamed(chunk.error, names).kserve_body())}\n\n"
                return
            text = "".join(d.text for d in chunk.deltas)
            finish = next((d.finish_reason for d in chunk.deltas if d.finish_reason), None)
            if text or finish:
                yield f"data: {json.dumps({**base, 'text_output': text, 'finish_reason': finish})}\n\n"
            if chunk.usage is not None:
                request.state.prompt_tokens, request.state.completion_tokens = chunk.usage
    finally:
        await rest.aclose()
