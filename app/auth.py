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


def runtime_of(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


# `async def`: FastAPI runs a plain `def` dependency in a thread pool, which costs more than
# a Redis round trip. The hot routes (submit, status) call `api_key` directly instead.
async def runtime(request: Request) -> Runtime:
    return runtime_of(request)


def api_key(request: Request) -> ApiKey:
    """The caller's key, from process memory (the mirror): no round trip on the hot path."""
    presented = _presented(request)
    if not presented:
        raise ApiError(401, "unauthorized", "an API key is required (Authorization: Bearer ...)",
                       {"WWW-Authenticate": "Bearer"})
    key = runtime_of(request).api_keys.items.get(hash_key(presented))
    if key is None:
        raise ApiError(401, "unauthorized", "unknown or revoked API key",
                       {"WWW-Authenticate": "Bearer"})
    return key


async def admin(request: Request) -> None:
    presented = _presented(request) or ""
    expected = runtime_of(request).settings.admin_secret
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "the admin token is required",
                       {"WWW-Authenticate": "Bearer"})
