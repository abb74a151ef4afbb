"""The gateway's state: served models, their tokenizers, request plumbing shared by the APIs.

The gateway tokenizes prompts and renders chat templates itself (with the checkpoint's
tokenizer.json, fetched from a ModelServer replica once), so replicas receive token ids and the
engine loop never spends time on text it does not need. It imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request

from deploy.schema import RequestLimits
from engines.core.sampling_params import RequestError, SamplingParams
from engines.loading.tokenizer import Tokenizer
from serving import errors
from serving.auth import hash_key
from serving.backends import ModelBackend
from serving.errors import APIError
from serving.limits import apply_limits
from serving.metrics import GatewayMetrics, Metric, merge, render
from serving.wire import ErrorInfo, GenerateChunk, GenerateRequest, ModelInfo

JSON_TYPES = ("application/json",)


@dataclass(frozen=True)
class GatewayOptions:
    max_body_bytes: int = 1 << 20
    rate_limit_rps: float | None = None
    rate_limit_burst: int = 10
    max_concurrent_per_key: int | None = None
    """Per-key limits (deploy/schema.py ServerSpec; serving/ratelimit.py)."""
    limits: RequestLimits = RequestLimits()
    """Per-request limits (n, prompt and output tokens, stop, logprobs), checked in `open`."""
    api_key_hashes: frozenset[str] = frozenset()
    """sha256 of each accepted API key; empty disables auth (the gateway never holds the keys)."""
    admin_key_hashes: frozenset[str] = frozenset()
    """sha256 of each admin key (p-tuning admin routes); with user keys but none of these, those
    routes are refused."""
    log_requests: bool = True
    replica: str = "gateway"
    behind_ray_proxy: bool = False
    """Ray Serve's proxy already assigns X-Request-Id (keeping a client's) and echoes it in the
    response; the gateway then adopts it instead of adding a second header."""

    @classmethod
    def from_server(cls, server: Any, api_keys: list[str], replica: str = "gateway",
                    admin_keys: list[str] = ()) -> GatewayOptions:
        return cls(max_body_bytes=server.max_body_bytes, api_key_hashes=frozenset(hash_key(k) for k in api_keys),
                   log_requests=server.log_requests, replica=replica,
                   admin_key_hashes=frozenset(hash_key(k) for k in admin_keys), **rate_limits(server))


def rate_limits(server: Any) -> dict[str, Any]:
    """The per-key limits of a ServerSpec, as GatewayOptions fields."""
    return {"limits": server.limits, "rate_limit_rps": server.rate_limit_rps, "rate_limit_burst": server.rate_limit_burst,
            "max_concurrent_per_key": server.max_concurrent_per_key}


@dataclass
class ServedModel:
    name: str
    backend: ModelBackend
    info: ModelInfo
    tokenizer: Tokenizer | None
    _token_text: dict[int, str] = field(default_factory=dict)
    _token_bytes: dict[int, bytes] = field(default_factory=dict)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise errors.invalid(f"{param}: model {self.name!r} has no tokenizer; send token ids", param)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise errors.invalid(f"{param}: encodes to zero tokens", param)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, for chat logprobs (right also for part of a UTF-8 character)."""
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else self.token_text(token_id).encode()
            self._token_bytes[token_id] = b
        return b

    def token_text(self, token_id: int) -> str:
        """A token as text, for logprobs (cached: the same ids recur)."""
        t = self._token_text.get(token_id)
        if t is None:
            if self.tokenizer is None:
                t = f"token_id:{token_id}"
            else:
                t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = t
        return t


class Gateway:
    def __init__(self, backends: dict[str, ModelBackend], options: GatewayOptions | None = None,
                 remote_metrics: Callable[[], Awaitable[list[list[Metric]]]] | None = None):
        self.backends = backends
        self.options = options or GatewayOptions()
        self.remote_metrics = remote_metrics
        self.metrics = GatewayMetrics(self.options.replica)
        self._models: dict[str, ServedModel] = {}
        self._locks = {name: asyncio.Lock() for name in backends}

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def created(self, name: str) -> int:
        """Load time of a model whose replicas have answered already (0 before)."""
        m = self._models.get(name)
        return m.info.created if m is not None else 0

    def weight_dtype(self, name: str) -> str | None:
        """Weight storage (fp8, bfloat16, ...) of a model whose replicas have answered already."""
        m = self._models.get(name)
        return (m.info.weight_dtype or None) if m is not None else None

    async def model(self, name: Any, param: str = "model") -> ServedModel:
        """The served model called `name`: 404 if unknown, 503 if no replica can describe it."""
        if not isinstance(name, str):
            raise errors.invalid(f"{param}: must be a string", param, "invalid_type")
        m = self._models.get(name)
        if m is not None:
            return m
        if name not in self.backends:
            raise errors.model_not_found(name, self.names)
        async with self._locks[name]:
            if name not in self._models:
                backend = self.backends[name]
                try:
                    info = await backend.info()
                except Exception as exc:  # noqa: BLE001 - replicas still starting, or all dead
                    raise APIError(errors.engine_unavailable(f"model {name!r} is not available: {exc}")) from None
                tk = None
                if info.tokenizer_json is not None:
                    from tokenizers import Tokenizer as HFTokenizer

                    tk = Tokenizer(HFTokenizer.from_str(info.tokenizer_json), info.chat_template, info.bos_token,
                                   info.eos_token)
                self._models[name] = ServedModel(name, backend, info, tk)
        return self._models[name]

    async def open(self, model: ServedModel, req: GenerateRequest, default_max_tokens: int | None = None
                   ) -> tuple[GenerateChunk, AsyncIterator[GenerateChunk]]:
        """Send the request; return its first chunk and the stream of the rest (aclose it when done).

        The first chunk tells success from failure (admission, validation), so errors become
        proper HTTP statuses before any streamed byte is sent. A max_tokens left unset (None)
        becomes `default_max_tokens` (None: up to the context) within server.limits.max_tokens.
        """
        return await self._open(model, apply_limits(req, self.options.limits, default_max_tokens))

    async def _open(self, model: ServedModel, req: GenerateRequest
                    ) -> tuple[GenerateChunk, AsyncIterator[GenerateChunk]]:
        stream = model.backend.generate(req)
        try:
            first = await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise
        if first.error is not None:
            await stream.aclose()
            raise APIError(first.error)
        return first, stream

    async def metrics_text(self) -> bytes:
        sources = [self.metrics.families()]
        if self.remote_metrics is not None:
            sources.extend(await self.remote_metrics())
        return render(merge(sources))


def renamed(info: ErrorInfo, names: dict[str, str]) -> ErrorInfo:
    """`info` in a route's own field names: the engine and the limits name SamplingParams fields
    (prompt, max_tokens, logprobs), which a route may carry under another name (a chat's messages,
    max_completion_tokens, top_logprobs). `names` maps the former to the latter."""
    head = re.match(r"[A-Za-z_]\w*", info.param or "")
    new = names.get(head.group(0)) if head else None
    if new is None:
        return info
    message = re.sub(rf"\b{head.group(0)}\b", new, info.message)
    return dataclasses.replace(info, param=new + info.param[head.end():], message=message)


def sampling_params(defaults: dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
    """A request's SamplingParams: `kwargs` are the fields the request set, `defaults` (the model's
    generation_config.json values, ModelInfo.sampling_defaults) fill the ones it left unset."""
    try:
        return SamplingParams(**{**(defaults or {}), **kwargs})
    except RequestError as exc:
        raise APIError(ErrorInfo(400, "invalid_request_error", str(exc), exc.param, exc.code or "invalid_value"))


def new_request_id() -> str:
    return uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, its Content-Encoding undone (decompressed), refusing more than max_bytes (413) whether or not
    Content-Length is honest, before and after inflating."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise errors.invalid("Content-Length: not an integer", None, "invalid_header") from None
        if size > max_bytes:
            raise too_large(max_bytes)
    chunks, total = [], 0
    try:
        async for part in request.stream():
            total += len(part)
            if total > max_bytes:
                raise too_large(max_bytes)
            chunks.append(part)
    except ClientDisconnect:
        raise errors.invalid("the client closed the connection while sending the body", None,
                             "client_disconnected") from None
    return decompressed(request, b"".join(chunks), max_bytes)


def decompressed(request: Request, raw: bytes, max_bytes: int) -> bytes:
    """The body with its Content-Encoding undone, for every route (tritonclient's
    request_compression_algorithm sends gzip or deflate, and an HTTP client may compress a large
    /v1 prompt; Inference-Header-Content-Length counts the decompressed bytes).

    The decompressed size is capped at the body limit: a few KB of gzip can inflate to gigabytes,
    so the cap is applied while inflating, not after.
    """
    enc = (request.headers.get("content-encoding") or "identity").strip().lower()
    if enc == "identity":
        return raw
    if enc not in ("gzip", "deflate"):
        raise errors.invalid(f"Content-Encoding: {enc!r} is not supported; send gzip, deflate or identity", None,
                             "unsupported_content_encoding", status=415)
    # gzip: 16 + MAX_WBITS; deflate is a zlib stream (RFC 9110, and what tritonclient sends), though some
    # clients send a raw deflate stream: told apart by the zlib header's check bits
    zlib_header = len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0
    wbits = 16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise errors.invalid(f"Content-Encoding: the body is not valid {enc} data ({exc})", None,
                             "invalid_content_encoding") from None
    if len(out) > max_bytes:
        raise errors.invalid(f"request body decompresses ({enc}) to more than the limit of {max_bytes} bytes", None,
                             "request_too_large", status=413)
    if not d.eof:
        raise errors.invalid(f"Content-Encoding: the {enc} body is truncated", None, "invalid_content_encoding")
    return out


def too_large(max_bytes: int) -> APIError:
    return errors.invalid(f"request body is larger than the limit of {max_bytes} bytes", None,
                          "request_too_large", status=413)


def check_json_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return  # curl without -H and some SDKs send none: accept the body as JSON
    media = ctype.split(";")[0].strip().lower()
    if media not in JSON_TYPES and not media.endswith("+json"):
        raise errors.invalid(f"Content-Type must be application/json, got {ctype!r}", None,
                             "unsupported_media_type", status=415)


def decode_json(raw: bytes) -> dict:
    if not raw.strip():
        raise errors.invalid("request body is empty; send a JSON object", None, "invalid_json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.invalid(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:
        raise errors.invalid("request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.invalid("request body must be a JSON object", None, "invalid_json")
    return data


async def read_json(request: Request, gw: Gateway) -> dict:
    check_json_content_type(request)
    return decode_json(await read_body(request, gw.options.max_body_bytes))


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway
