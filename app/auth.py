"""Who is calling: API keys for the public routes, the admin token for the admin routes."""

from __future__ import annotations

import hmac

from fastapi import Request

from app.errors import ApiError
from app.runtime import Runtime
from app.store import ApiKey, hash_key


def _presented(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def api_key(request: Request) -> ApiKey:
    """The caller's key, from process memory (the mirror): no round trip on the hot path."""
    presented = _presented(request)
    if not presented:
        raise ApiError(401, "unauthorized", "an API key is required (Authorization: Bearer ...)",
                       {"WWW-Authenticate": "Bearer"})
    key = runtime(request).api_keys.items.get(hash_key(presented))
    if key is None:
        raise ApiError(401, "unauthorized", "unknown or revoked API key",
                       {"WWW-Authenticate": "Bearer"})
    return key


def admin(request: Request) -> None:
    presented = _presented(request) or ""
    expected = runtime(request).settings.admin_secret
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "the admin token is required",
                       {"WWW-Authenticate": "Bearer"})
