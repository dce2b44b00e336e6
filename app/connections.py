"""A bound on the requests and connections the API serves at once, below the open-files limit.

Every connection holds a descriptor. Past the process's limit the server cannot accept at all:
with a hard limit of 1,024, 1,100 slow uploads made `/healthz` fail to connect until they
timed out, so an orchestrator would restart a gateway that was merely busy. So the API answers
`503` (Retry-After, `Connection: close`) at once to a request beyond `QGW_MAX_CONNECTIONS`,
before reading its body, which frees its descriptor; the probes (`/healthz`, `/readyz`,
`/metrics`) are never refused here. Uvicorn's own `limit_concurrency` sits a little above, as
the last line for connections that never become requests; the descriptors left over are for
Redis, the database and the upstream calls of an in-process dispatcher."""

from __future__ import annotations

import json
from typing import Any

from app.settings import Settings

#: Never refused by the cap: an orchestrator must see a busy gateway as alive.
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
#: Connections above the request cap uvicorn still takes (probes, keep-alive connections).
PROBE_ROOM = 32
#: Share of the open-files limit the cap takes by default; the rest is the process's own.
SHARE = 0.75
_BUSY = json.dumps({"error": {"code": "too_many_connections", "message":
                              "the gateway serves as many requests as it may at once; retry"}}
                   ).encode()


def open_files_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def max_requests(settings: Settings) -> int | None:
    """The cap on requests in flight: QGW_MAX_CONNECTIONS, or by default 3/4 of the
    open-files limit (None: no limit known, no cap)."""
    if settings.max_connections:
        return settings.max_connections
    fds = open_files_limit()
    return max(16, int(fds * SHARE)) if fds else None


def uvicorn_limit(settings: Settings) -> int | None:
    """Uvicorn's `limit_concurrency`: the request cap and room for probes above it."""
    cap = max_requests(settings)
    return None if cap is None else cap + PROBE_ROOM


class RequestCap:
    """Pure ASGI middleware: beyond `limit` requests in flight, 503 at once and close."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", b"1"),
                (b"content-length", str(len(_BUSY)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": _BUSY})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
