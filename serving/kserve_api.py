"""KServe v2 / Triton inference protocol: health, metadata, infer, and the generate extension.

`/infer` takes a BYTES tensor `text_input` (shape [B] or [B, 1]: B prompts) and returns a BYTES
tensor `text_output` of the same shape. Generation parameters come as one-element input tensors
(`max_tokens` INT32, `temperature` FP32, ...) or in the request's `parameters`. Tensors may be
JSON or use Triton's binary tensor extension, so `tritonclient.http` works with its defaults.
Errors keep the OpenAI-shaped body used everywhere else; tritonclient shows it as the message.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from serving import errors
from serving.errors import APIError
from serving.gateway import (
    Gateway,
    ServedModel,
    check_json_content_type,
    decode_json,
    gateway_of,
    new_request_id,
    read_body,
    read_json,
    sampling_params,
)
from serving.openai_api import SSE_HEADERS, _chunks
from serving.protocol import INT32_MAX, SEED_MAX, SEED_MIN, _Body, parse
from serving.wire import GenerateChunk, GenerateRequest

router = APIRouter()
VERSION = "1"
TRITON_RESERVED = {"binary_data_output", "sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                   "headers"}
# (datatype, struct code, size) of the numeric tensor types the binary extension carries
_NUMERIC = {"BOOL": ("?", 1), "INT8": ("b", 1), "INT16": ("h", 2), "INT32": ("i", 4), "INT64": ("q", 8),
            "UINT8": ("B", 1), "UINT16": ("H", 2), "UINT32": ("I", 4), "UINT64": ("Q", 8), "FP32": ("f", 4),
            "FP64": ("d", 8)}


class GenerateParams(_Body):
    """Generation parameters of the v2 routes (a subset of the OpenAI ones, same ranges)."""

    max_tokens: Annotated[int, Field(ge=1)] | None = 16
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

    def to_sampling(self):
        kw = {k: v for k, v in self.model_dump().items() if v is not None and k != "max_tokens"}
        if isinstance(kw.get("stop"), list):
            kw["stop"] = tuple(kw["stop"])
        return sampling_params(max_tokens=self.max_tokens, **kw)


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
            return JSONResponse(errors.engine_unavailable(f"model {name!r} is not ready").body(), status_code=503)
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
    return JSONResponse(errors.engine_unavailable(f"model {name!r} is not ready").body(), status_code=503)


# infer
def _split_binary(request: Request, raw: bytes) -> tuple[dict, bytes]:
    header = request.headers.get("inference-header-content-length")
    if header is None:
        check_json_content_type(request)
        return decode_json(raw), b""
    try:
        size = int(header)
    except ValueError:
        raise errors.invalid("Inference-Header-Content-Length: not an integer", None, "invalid_header") from None
    if not 0 < size <= len(raw):
        raise errors.invalid(f"Inference-Header-Content-Length: {size} is outside the body of {len(raw)} bytes",
                             None, "invalid_header")
    return decode_json(raw[:size]), raw[size:]


def _or_empty(value: Any, empty: Any) -> Any:
    """`empty` for an absent or null field, else the value as sent (false or 0 stay, to be refused)."""
    return empty if value is None else value


def _flatten(data: Any) -> list:
    if isinstance(data, list):
        out = []
        for x in data:
            out.extend(_flatten(x))
        return out
    return [data]


def _decode_bytes(buf: bytes, param: str) -> list[str]:
    out, i = [], 0
    while i < len(buf):
        if i + 4 > len(buf):
            raise errors.invalid(f"{param}: truncated BYTES tensor", param)
        (n,) = struct.unpack_from("<I", buf, i)
        i += 4
        if i + n > len(buf):
            raise errors.invalid(f"{param}: truncated BYTES tensor", param)
        out.append(_utf8(buf[i:i + n], param))
        i += n
    return out


def _utf8(b: Any, param: str) -> str:
    if isinstance(b, str):
        return b
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid(f"{param}: BYTES elements must be UTF-8 text", param) from None


def _tensor_values(t: dict, i: int, blob: bytes, offset: int) -> tuple[str, list, list[int], int]:
    """(name, flat values, shape, new blob offset) of inputs[i]."""
    param = f"inputs[{i}]"
    if not isinstance(t, dict):
        raise errors.invalid(f"{param}: must be an object with name, shape, datatype and data", param)
    unknown = set(t) - {"name", "shape", "datatype", "data", "parameters"}
    if unknown:
        raise errors.invalid(f"{param}: unknown field(s) {', '.join(sorted(unknown))}", param, "unknown_parameter")
    name, shape, dtype = t.get("name"), t.get("shape"), t.get("datatype")
    if not isinstance(name, str):
        raise errors.invalid(f"{param}.name: must be a string", f"{param}.name", "invalid_type")
    param = f"inputs[{name}]"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise errors.invalid(f"{param}.shape: must be a list of non-negative integers", f"{param}.shape")
    if not isinstance(dtype, str) or (dtype != "BYTES" and dtype not in _NUMERIC):
        # a non-string (an object, a list) is refused by name too: it is not hashable, so the
        # membership test alone raised TypeError, a 500
        raise errors.invalid(f"{param}.datatype: {dtype!r} is not a tensor type; one of BYTES, "
                             f"{', '.join(_NUMERIC)}", f"{param}.datatype", "invalid_type")
    count = math.prod(shape)
    params = _or_empty(t.get("parameters"), {})
    if not isinstance(params, dict):
        raise errors.invalid(f"{param}.parameters: must be an object", f"{param}.parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(blob):
            raise errors.invalid(f"{param}: binary_data_size {size!r} does not fit the binary body", param)
        buf = blob[offset:offset + size]
        offset += size
        if dtype == "BYTES":
            values: list = _decode_bytes(buf, param)
        else:
            code, width = _NUMERIC[dtype]
            if len(buf) != count * width:
                raise errors.invalid(f"{param}: {len(buf)} bytes do not hold {count} {dtype} values", param)
            values = list(struct.unpack(f"<{count}{code}", buf))
    else:
        if "data" not in t:
            raise errors.invalid(f"{param}.data: missing (or give parameters.binary_data_size)", f"{param}.data",
                                 "missing_required_parameter")
        values = _flatten(t["data"])
        if dtype == "BYTES":
            values = [_utf8(v, param) if isinstance(v, str) else _bad_bytes(param) for v in values]
    if len(values) != count:
        raise errors.invalid(f"{param}: shape {shape} needs {count} values, got {len(values)}", param)
    return name, values, shape, offset


def _bad_bytes(param: str):
    raise errors.invalid(f"{param}: BYTES data must be strings", param, "invalid_type")


def _scalar(name: str, values: list) -> Any:
    if len(values) != 1:
        raise errors.invalid(f"inputs[{name}]: a parameter tensor holds exactly one value, got {len(values)}",
                             f"inputs[{name}]")
    return values[0]


def _params_from(values: dict[str, Any], where: str) -> GenerateParams:
    try:
        return parse(GenerateParams, values)
    except APIError as exc:
        info = exc.info
        raise APIError(type(info)(info.status, info.type, f"{where}: {info.message}", info.param, info.code)) from None


@router.post("/v2/models/{name}/infer")
@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    gw: Gateway = gateway_of(request)
    m = await _model(request, name, version)
    body, blob = _split_binary(request, await read_body(request, gw.options.max_body_bytes))
    unknown = set(body) - {"id", "inputs", "outputs", "parameters"}
    if unknown:
        raise errors.invalid(f"Unrecognized request argument supplied: {', '.join(sorted(unknown))}",
                             min(unknown), "unknown_parameter")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise errors.invalid("inputs: must be a non-empty list of tensors", "inputs", "missing_required_parameter")
    req_params = _or_empty(body.get("parameters"), {})
    if not isinstance(req_params, dict):
        raise errors.invalid("parameters: must be an object", "parameters", "invalid_type")
    gen_values = {k: v for k, v in req_params.items() if k not in TRITON_RESERVED}
    binary_out = bool(req_params.get("binary_data_output", False))
    texts, shape, offset = None, None, 0
    for i, t in enumerate(inputs):
        tname, values, tshape, offset = _tensor_values(t, i, blob, offset)
        if tname == "text_input":
            if t.get("datatype") != "BYTES":
                raise errors.invalid("inputs[text_input].datatype: must be BYTES", "inputs[text_input].datatype")
            texts, shape = values, tshape
        elif tname == "stop":  # a BYTES tensor of shape [-1]: one stop string per element
            gen_values[tname] = list(values)
        elif tname in GenerateParams.model_fields:
            v = _scalar(tname, values)
            if t.get("datatype") == "BOOL":
                v = bool(v)
            gen_values[tname] = v
        elif tname == "stream":
            if _scalar(tname, values):
                raise errors.invalid("inputs[stream]: /infer does not stream; use /generate_stream", "stream")
        else:
            raise errors.invalid(f"inputs[{tname}]: unknown input; known: text_input, "
                                 f"{', '.join(GenerateParams.model_fields)}", f"inputs[{tname}]", "unknown_parameter")
    if texts is None:
        raise errors.invalid("inputs: a BYTES tensor named text_input is required", "inputs[text_input]",
                             "missing_required_parameter")
    if not texts:
        raise errors.invalid("inputs[text_input]: holds no prompt", "inputs[text_input]")
    outputs = _or_empty(body.get("outputs"), [])
    if not isinstance(outputs, list):
        raise errors.invalid("outputs: must be a list of requested outputs", "outputs", "invalid_type")
    for o in outputs:
        if not isinstance(o, dict) or o.get("name") != "text_output":
            raise errors.invalid("outputs: the only output is text_output", "outputs")
        if not isinstance(_or_empty(o.get("parameters"), {}), dict):
            raise errors.invalid("outputs[text_output].parameters: must be an object",
                                 "outputs[text_output].parameters", "invalid_type")
        if (o.get("parameters") or {}).get("binary_data"):
            binary_out = True
    task = _task(gen_values)
    params = _params_from(gen_values, "parameters").to_sampling()
    ids = [m.encode(text, "inputs[text_input]") for text in texts]
    first, rest = await gw.open(m, GenerateRequest(new_request_id(), ids, params, task=task))
    out = [""] * len(ids)
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                raise APIError(chunk.error)
            for d in chunk.deltas:
                out[d.index] += d.text
            if chunk.usage is not None:
                request.state.prompt_tokens, request.state.completion_tokens = chunk.usage
    finally:
        await rest.aclose()
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


# the generate extension
async def _generate_request(request: Request, m: ServedModel, stream: bool) -> tuple[GenerateRequest, dict]:
    body = await read_json(request, gateway_of(request))
    text = body.get("text_input")
    if not isinstance(text, str) or not text:
        raise errors.invalid("text_input: required, a non-empty string", "text_input",
                             "missing_required_parameter" if text is None else "invalid_value")
    values = {k: v for k, v in body.items() if k not in ("text_input", "parameters", "id", "stream")}
    nested = _or_empty(body.get("parameters"), {})  # null: none; false or 0 are not an object
    if not isinstance(nested, dict):
        raise errors.invalid("parameters: must be an object", "parameters", "invalid_type")
    both = set(values) & set(nested)
    if both:
        raise errors.invalid(f"{min(both)}: given both at the top level and in parameters", min(both))
    values.update({k: v for k, v in nested.items() if k not in TRITON_RESERVED and k != "stream"})
    task = _task(values)
    params = _params_from(values, "parameters").to_sampling()
    ids = [m.encode(text, "text_input")]
    return GenerateRequest(new_request_id(), ids, params, task=task, stream=stream), body


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
    req, body = await _generate_request(request, m, stream=False)
    first, rest = await gw.open(m, req)
    text, finish = "", None
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                raise APIError(chunk.error)
            for d in chunk.deltas:
                text += d.text
                finish = d.finish_reason or finish
            if chunk.usage is not None:
                request.state.prompt_tokens, request.state.completion_tokens = chunk.usage
    finally:
        await rest.aclose()
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
    req, body = await _generate_request(request, m, stream=True)
    first, rest = await gw.open(m, req)
    base: dict[str, Any] = {"model_name": m.name, "model_version": VERSION}
    if isinstance(body.get("id"), str):
        base["id"] = body["id"]
    return StreamingResponse(_stream(request, base, first, rest), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _stream(request: Request, base: dict, first: GenerateChunk,
                  rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                request.state.stream_error = chunk.error.code
                yield f"data: {json.dumps(chunk.error.body())}\n\n"
                return
            text = "".join(d.text for d in chunk.deltas)
            finish = next((d.finish_reason for d in chunk.deltas if d.finish_reason), None)
            if text or finish:
                yield f"data: {json.dumps({**base, 'text_output': text, 'finish_reason': finish})}\n\n"
            if chunk.usage is not None:
                request.state.prompt_tokens, request.state.completion_tokens = chunk.usage
    finally:
        await rest.aclose()
