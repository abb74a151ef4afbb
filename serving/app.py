"""The gateway's FastAPI app: the same routes and checks in-process and as the Ray Serve ingress.

`build_app(gateway)` takes a Gateway whose model backends are either in-process engines
(`create_local_app`, for tests and tools) or Ray Serve DeploymentHandles (serving/deployments.py).
An outer ASGI middleware gives every request an id (echoed in `X-Request-Id`), enforces API keys,
writes one structured log line per request, counts responses by status, and turns any unexpected
exception into a 500 that still carries the request id.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving import errors, kserve_api, openai_api, ptuning_api, steps_api
from serving.errors import APIError
from serving.gateway import Gateway, GatewayOptions, gateway_of, hash_key, new_request_id
from serving.metrics import CONTENT_TYPE
from serving.ratelimit import KeyLimiter
from serving.wire import ErrorInfo

if TYPE_CHECKING:
    from deploy.schema import DeploymentConfig
    from serving.model_core import ModelCore

access_log = logging.getLogger("shardserve.access")
log = logging.getLogger("shardserve.gateway")
ADMIN_PREFIX = ("/v1/ptuning/", "/v1/admin/")
"""Routes that need an admin key instead (serving/ptuning_api.py, serving/steps_api.py)."""
HEALTH_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready", "/openapi.json"})  # no key needed
GENERATE_PATH = re.compile(r"^/v1/(chat/)?completions$|^/v2/models/.+/(generate|generate_stream|infer)$")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def build_app(gateway: Gateway, on_shutdown: Callable[[], Awaitable[None]] | None = None,
              on_startup: Callable[[FastAPI], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_startup is not None:
            on_startup(app)
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="shardserve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    app.include_router(openai_api.router)
    app.include_router(kserve_api.router)
    app.include_router(ptuning_api.router)  # admin keys checked by the router itself
    app.include_router(steps_api.router)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(await gateway_of(request).metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        from serving.openapi import build_openapi

        if app.state.openapi is None:
            app.state.openapi = build_openapi(app, list(gateway.backends), gateway.options.limits)
        return JSONResponse(app.state.openapi)

    app.state.openapi = None

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await kserve_api.ready(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.info, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            info = ErrorInfo(404, "invalid_request_error", f"no route {request.method} {request.url.path}",
                             None, "not_found")
        elif exc.status_code == 405:
            info = ErrorInfo(405, "invalid_request_error", f"method {request.method} is not allowed on "
                             f"{request.url.path}", None, "method_not_allowed")
        else:
            info = ErrorInfo(exc.status_code, "invalid_request_error", str(exc.detail), None, None)
        resp = error_response(info, request.url.path)
        resp.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow (RFC 9110): every route of the path, not only the first one matched
            methods = _methods_of(request.app.router.routes, request.url.path)
            if methods:
                resp.headers["Allow"] = ", ".join(sorted(methods))
        return resp

    app.add_middleware(GatewayMiddleware, gateway=gateway)
    return app


def _methods_of(routes, path: str) -> set[str]:
    """The methods of every route whose path matches (routers included without a prefix, as here)."""
    out: set[str] = set()
    for r in routes:
        sub = getattr(r, "original_router", None)  # FastAPI >= 0.165 wraps an included router
        if sub is not None:
            out |= _methods_of(sub.routes, path)
        elif getattr(r, "methods", None) and getattr(r, "path_regex", None) is not None and r.path_regex.match(path):
            out |= set(r.methods)
    return out


def error_response(info: ErrorInfo, path: str = "") -> JSONResponse:
    """The error as its API's clients parse it (serving/errors.py body_for): `path` is the request's."""
    headers = {"Retry-After": str(info.retry_after_s)} if info.retry_after_s else None
    return JSONResponse(errors.body_for(info, path), status_code=info.status, headers=headers)


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, gateway: Gateway):
        self.app = app
        self.gateway = gateway
        self.keys = gateway.options.api_key_hashes
        o = gateway.options
        self.limiter = KeyLimiter(o.rate_limit_rps, o.rate_limit_burst, o.max_concurrent_per_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        incoming = _header(scope, b"x-request-id")
        proxied = self.gateway.options.behind_ray_proxy and incoming
        rid = incoming if proxied or (incoming and REQUEST_ID.match(incoming)) else new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = {"code": 0}
        extra = [] if proxied else [(b"x-request-id", rid.encode())]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            if self.keys and scope["path"] not in HEALTH_PATHS and not scope["path"].startswith(ADMIN_PREFIX) \
                    and not self._authorized(scope):
                await error_response(ErrorInfo(
                    401, "invalid_request_error", "a valid API key is required: send `Authorization: Bearer <key>`",
                    None, "invalid_api_key"), scope["path"])(scope, receive, _with_auth_challenge(send_with_id))
            elif self.limiter.enabled and scope["method"] == "POST" and GENERATE_PATH.search(scope["path"]):
                await self._limited(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as exc:  # the error boundary: answer 500 if nothing was sent yet
            if status["code"] == 0:
                log.exception("request %s %s failed", rid, scope.get("path"))
                await error_response(errors.internal(f"internal server error (request id {rid})"),
                                     scope["path"])(scope, receive, send_with_id)
            else:  # the response had started: the connection broke (typically the client left)
                log.info("request %s %s: response cut short: %r", rid, scope.get("path"), exc)
                state["stream_error"] = "disconnected"
        finally:
            self._finish(scope, state, rid, status["code"] or 499, time.monotonic() - t0)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        auth = (_header(scope, b"authorization") or "").partition(" ")[2].strip()
        key = hash_key(auth) if self.keys and auth else "client:" + str((scope.get("client") or ("?",))[0])
        refused = self.limiter.acquire(key)
        if refused is not None:
            reason, retry = refused
            await error_response(ErrorInfo(429, "rate_limit_error", f"rate limit: {reason}; retry after {retry} s",
                                           None, "rate_limit_exceeded", retry), scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(key)

    def _authorized(self, scope: Scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        digest = hash_key(key.strip())
        return any(hmac.compare_digest(digest, h) for h in self.keys)

    def _finish(self, scope: Scope, state: dict[str, Any], rid: str, status: int, seconds: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        model = state.get("model", "")
        self.gateway.metrics.observe(path, model, status)
        if not self.gateway.options.log_requests:
            return
        record = {"event": "request", "request_id": rid, "method": scope.get("method"), "path": scope.get("path"),
                  "status": status, "duration_ms": round(seconds * 1000, 2), "model": model or None}
        for key in ("stream", "prompt_tokens", "completion_tokens", "stream_error"):
            if key in state:
                record[key] = state[key]
        client = scope.get("client")
        if client:
            record["client"] = client[0]
        access_log.info(json.dumps(record))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


def _with_auth_challenge(send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"www-authenticate", b"Bearer")]}
        await send(message)
    return wrapped


# the in-process app (no Ray): tests, benchmarks' baselines, single-process tools
def create_local_app(config: DeploymentConfig, api_keys: list[str] | None = None,
                     cores: dict[str, ModelCore] | None = None, admin_keys: list[str] | None = None) -> FastAPI:
    """The gateway app with each model's engine in this process. Loads the models (seconds) unless
    `cores` already holds them; on app shutdown, drains and stops the engines."""
    from serving.backends import LocalBackend
    from serving.model_core import ModelCore

    server = config.server
    if cores is None:
        cores = {m.name: ModelCore.load(m, request_timeout_s=server.request_timeout_s) for m in config.models}
    backends = {name: LocalBackend(core) for name, core in cores.items()}

    async def model_metrics():
        return [core.metrics.families() for core in cores.values()]

    gateway = Gateway(backends, GatewayOptions.from_server(server, api_keys or [], admin_keys=admin_keys or []),
                      model_metrics)

    async def shutdown() -> None:
        for core in cores.values():
            await core.shutdown(server.drain_timeout_s)

    return build_app(gateway, on_shutdown=shutdown)
