"""Errors are part of the interface: every failure the gateway returns has the right status (4xx
for client mistakes, 429 when overloaded, 503 when the engine is gone) and the body its API's
clients parse: OpenAI's `{"error": {"message", "type", "param", "code"}}`, except under /v2, where
KServe v2 clients (tritonclient) read `{"error": "<message>"}` (type, param, code beside it)."""

from __future__ import annotations

from serving.wire import ErrorInfo


def is_kserve_path(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def body_for(info: ErrorInfo, path: str) -> dict:
    """The error body for a request to `path`: the KServe v2 shape under /v2, OpenAI's elsewhere."""
    return info.kserve_body() if is_kserve_path(path) else info.body()


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into a JSON error response."""

    def __init__(self, info: ErrorInfo):
        super().__init__(info.message)
        self.info = info


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value",
            status: int = 400) -> APIError:
    return APIError(ErrorInfo(status, "invalid_request_error", message, param, code))


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(ErrorInfo(404, "invalid_request_error", message, param, code))


def model_not_found(name: object, known: list[str]) -> APIError:
    return not_found(f"The model {name!r} does not exist; served models: {', '.join(known)}",
                     code="model_not_found", param="model")


def overloaded(model: str, retry_after_s: int, why: str = "too many waiting requests") -> ErrorInfo:
    return ErrorInfo(429, "rate_limit_error", f"model {model!r} is at its admission limit ({why}); retry later",
                     None, "server_overloaded", retry_after_s)


def ttft_slo_unreachable(model: str, retry_after_s: int, slo_ms: float) -> ErrorInfo:
    """429 for an admitted request given up before its first token (serving/admission.py): its own
    code, so the gateway does not retry it as it retries a refusal at the door."""
    return ErrorInfo(429, "rate_limit_error", f"model {model!r} could not give this request its first token "
                     f"within the {slo_ms:g} ms TTFT SLO (too many requests ahead of it); retry later",
                     None, "ttft_slo_unreachable", retry_after_s)


def engine_unavailable(message: str) -> ErrorInfo:
    return ErrorInfo(503, "service_unavailable", message, None, "engine_unavailable")


def timed_out(timeout_s: float) -> ErrorInfo:
    # 408 as Ray Serve's own request timeout does: the server gave up waiting, not an internal error
    return ErrorInfo(408, "timeout_error", f"request did not finish within the server's timeout of "
                     f"{timeout_s:g} s; lower max_tokens or retry", None, "request_timeout")


def internal(message: str = "internal server error") -> ErrorInfo:
    return ErrorInfo(500, "server_error", message, None, "internal_error")
