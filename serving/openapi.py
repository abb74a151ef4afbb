"""The OpenAPI 3.1 document served at /openapi.json: the OpenAI /v1 and KServe v2 /v2 routes with
their request bodies (the same pydantic models the handlers validate with, so the limits are the
real ones), response bodies and the common error body.

The handlers read their bodies themselves (to answer errors in OpenAI's shape, naming the field),
so FastAPI cannot see the bodies: this module adds them to FastAPI's route list. Fields the
validators type as Any (prompt, stop, message content) get the schema of what the validator
accepts.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from deploy.schema import RequestLimits
from serving.kserve_api import VERSION, GenerateParams
from serving.kserve_tensors import _NUMERIC
from serving.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest

TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
PROMPT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": TOKEN_IDS}],
    "description": "A string, a list of strings, a list of token ids, or a list of token-id lists."}
STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
                  {"type": "null"}],
        "description": f"Up to {MAX_STOP} non-empty stop sequences."}
CONTENT = {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"], "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
KSERVE_ERROR = {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}
"""The /v2 routes' error body (serving/errors.py body_for): the KServe v2 protocol's message string."""
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
TOOL_CALLS = {"type": "array", "items": {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}}
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": FINISH}}}}}
CHAT = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "message", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "finish_reason": FINISH, "message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                           "tool_calls": TOOL_CALLS}}}}}}}
MODEL = {"type": "object", "required": ["id", "object"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"},
    "weight_dtype": {"type": "string", "description": "Storage of the blocks' Linear weights as served: fp8, "
                     "or the compute dtype (float32, bfloat16, float16); absent from the list until a "
                     "replica has described the model."}}}
INFER_TENSOR = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
    "name": {"type": "string"}, "datatype": {"type": "string", "enum": ["BYTES", *_NUMERIC]},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}}, "data": {},
    "parameters": {"type": "object"}}}
INFER_REQUEST = {"type": "object", "required": ["inputs"], "properties": {
    "id": {"type": "string"}, "parameters": {"type": "object"},
    "inputs": {"type": "array", "minItems": 1, "items": INFER_TENSOR},
    "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "parameters": {"type": "object"}}}}}}
GENERATE_REQUEST = {"type": "object", "required": ["text_input"], "properties": {
    "text_input": {"type": "string", "minLength": 1},
    "parameters": {"anyOf": [{"$ref": "#/components/schemas/GenerateParams"}, {"type": "null"}]}}}
SSE = {"text/event-stream": {"schema": {  # one server-sent event: its data is a JSON chunk or [DONE]
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def _model_schema(model: type, overrides: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs.update(schema.pop("$defs", {}))
    for name, sub in overrides.items():
        schema["properties"][name] = sub
    return schema


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _tighten(schema: dict[str, Any], field: str, key: str, value: int | None) -> None:
    """Lower the `key` bound (maximum, maxItems, ...) of a field to the server's limit."""
    if value is None or field not in schema["properties"]:
        return
    prop = schema["properties"][field]
    for sub in prop.get("anyOf", [prop]):
        if sub.get("type") in ("integer", "array") and key in ("maximum", "maxItems") and (
                sub.get("type") == "integer") == (key == "maximum"):
            sub[key] = min(sub.get(key, value), value)


def build_openapi(app: FastAPI, models: list[str], limits: RequestLimits | None = None) -> dict[str, Any]:
    """The document for `app` serving `models` (call once the routes are registered; the caller caches
    it). The served model names are enumerated: other names are answered 404, as documented."""
    doc = get_openapi(title="shardserve", version="1", routes=app.routes,
                      description="OpenAI-compatible /v1 and KServe v2 /v2 inference APIs.")
    defs: dict[str, Any] = {}
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["CompletionRequest"] = _model_schema(CompletionRequest, {"prompt": PROMPT, "stop": STOP}, defs)
    components["ChatCompletionRequest"] = _model_schema(ChatCompletionRequest, {"stop": STOP}, defs)
    components["GenerateParams"] = _model_schema(GenerateParams, {"stop": STOP}, defs)
    served = {"type": "string", "enum": sorted(models)}
    lim = limits or RequestLimits()
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateParams"):
        c = components[name]
        c["properties"]["stop"] = copy.deepcopy(STOP)
        _tighten(c, "stop", "maxItems", lim.max_stop)
        c["properties"]["stop"]["anyOf"][0]["maxLength"] = lim.max_stop_chars
        c["properties"]["stop"]["anyOf"][1]["items"]["maxLength"] = lim.max_stop_chars
        for field in ("n", "best_of"):
            _tighten(c, field, "maximum", lim.max_n)
        for field in ("logprobs", "top_logprobs"):
            _tighten(c, field, "maximum", lim.max_logprobs)
        _tighten(c, "max_tokens", "maximum", lim.max_tokens)
        _tighten(c, "max_completion_tokens", "maximum", lim.max_tokens)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        components[name]["properties"]["model"] = served
    if "ChatMessage" in defs:
        defs["ChatMessage"]["properties"]["content"] = CONTENT
    components.update(defs)
    components["Error"], components["KServeError"] = ERROR, KSERVE_ERROR
    error = {"description": "An error (4xx client mistake, 429 overloaded, 5xx server)",
             "content": _json({"$ref": "#/components/schemas/Error"})}
    kserve_error = {**error, "content": _json({"$ref": "#/components/schemas/KServeError"})}
    bodies = {
        "/v1/completions": ("CompletionRequest", {"200": {"description": "A completion, or an SSE stream when "
                                                  "stream is true", "content": {**_json(COMPLETION), **SSE}}}),
        "/v1/chat/completions": ("ChatCompletionRequest", {"200": {
            "description": "A chat completion, or an SSE stream", "content": {**_json(CHAT), **SSE}}}),
        "/v2/models/{name}/generate": (GENERATE_REQUEST, {"200": {"description": "Generated text",
                                                           "content": _json({"type": "object"})}}),
        "/v2/models/{name}/generate_stream": (GENERATE_REQUEST, {"200": {"description": "SSE stream",
                                                                  "content": SSE}}),
        "/v2/models/{name}/infer": (INFER_REQUEST, {"200": {"description": "Inference response", "content": {
            **_json({"type": "object"}), "application/octet-stream": {"schema": {"type": "string"}}}}}),
    }
    for path, ops in doc.get("paths", {}).items():
        key = path.replace("/versions/{version}", "")
        for method, op in ops.items():
            op.setdefault("responses", {})
            op["responses"].pop("422", None)  # FastAPI's own validation error: our handlers answer 400
            op["responses"]["default"] = kserve_error if key.startswith("/v2") else error
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "name":
                    param["schema"] = served
                elif param["in"] == "path" and param["name"] == "version":
                    param["schema"] = {"type": "string", "enum": [VERSION]}
            if key == "/metrics":
                op["responses"]["200"] = {"description": "Prometheus text format", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
            if key == "/v1/models":
                op["responses"]["200"] = {"description": "Served models", "content": _json({
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}})}
            elif key.endswith(("/live", "/ready", "/health")):  # the status is the answer; the body is empty
                op["responses"]["200"] = {"description": "Live / ready"}
            elif key.startswith("/v1/models/"):
                op["responses"]["200"] = {"description": "A served model", "content": _json(MODEL)}
            if method == "post" and key in bodies:
                body, responses = bodies[key]
                schema = {"$ref": f"#/components/schemas/{body}"} if isinstance(body, str) else body
                op["requestBody"] = {"required": True, "content": _json(schema)}
                op["responses"].update(responses)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
