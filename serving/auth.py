"""API keys: how they are hashed and the admin-key check of the admin routes.

A leaf of serving/ (it imports no other serving module), so that the gateway, the p-tuning routes
and the steps route all depend on it and never on each other for authentication.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from serving.errors import APIError
from serving.wire import ErrorInfo


def hash_key(key: str) -> str:
    """The SHA-256 hex digest the gateway keeps in place of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def require_admin(request: Request) -> None:
    """FastAPI dependency of the admin routes: passes when no keys are configured at all (an open
    development server) or when the bearer key is an admin key; 403 when admin keys are off or the
    key is a user key, 401 otherwise."""
    opts = request.app.state.gateway.options  # serving.gateway.GatewayOptions
    if not opts.api_key_hashes and not opts.admin_key_hashes:
        return
    if not opts.admin_key_hashes:
        raise APIError(ErrorInfo(403, "permission_error", "admin routes are disabled: no admin keys are configured "
                                 "(server.admin_api_keys_file or $SHARDSERVE_ADMIN_KEYS)", None, "admin_disabled"))
    scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
    digest = hash_key(key.strip()) if scheme.lower() == "bearer" and key.strip() else ""
    if not any(hmac.compare_digest(digest, h) for h in opts.admin_key_hashes):
        user = any(hmac.compare_digest(digest, h) for h in opts.api_key_hashes)
        raise APIError(ErrorInfo(403 if user else 401, "permission_error" if user else "invalid_request_error",
                                 "this route needs an admin API key: send `Authorization: Bearer <admin key>`",
                                 None, "admin_key_required"))
