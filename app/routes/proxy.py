"""`ANY /proxy/{endpoint_id}/{path}`: the drop-in proxy (docs/guides/proxy.md). The request
waits in its endpoint's line as a task, then goes to `target_url` + `{path}` and its answer
streams back (app/proxy/)."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import Receive

from app import tracing
from app.auth import api_key, runtime_of
from app.errors import ApiError
from app.models import MAX_PRIORITY
from app.proxy.paths import upstream_url
from app.proxy.relay import CALLER_LOST, CallerGone, ProxyCall
from app.proxy.response import RelayResponse
from app.routes.body import read_limited
from app.routes.tasks import ERRORS, IDEM_KEY

log = logging.getLogger(__name__)
router = APIRouter(tags=["proxy"])
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
DEFAULT_MAX_WAIT_S = 60.0
MAX_WAIT_S = 30 * 86_400
#: Request headers that stay here: the caller's gateway key, the gateway's own headers, the
#: caller's connection, and what the gateway sets itself (Idempotency-Key: the task id).
_KEPT = frozenset({"host", "authorization", "x-api-key", "content-length", "transfer-encoding",
                   "connection", "keep-alive", "te", "trailer", "upgrade", "expect",
                   "proxy-authorization", "proxy-connection", "accept-encoding",
                   "idempotency-key", "cookie"})


async def proxy(request: Request, endpoint_id: str, path: str) -> Response:
    """Call the endpoint's API through its line: `{path}` under its `target_url`."""
    caller, rt = api_key(request), runtime_of(request)
    endpoint = rt.registry.get(endpoint_id)
    if endpoint is None or not endpoint.enabled or not endpoint.proxy:
        raise ApiError(404, "endpoint_not_registered",
                       f"no enabled endpoint {endpoint_id!r} open to the proxy")
    rest, query = _rest(request, endpoint_id), request.scope.get("query_string", b"").decode(
        "latin-1")
    url = None if rest is None else upstream_url(endpoint.target_url, rest, query)
    if url is None or rest is None:
        raise ApiError(404, "path_not_allowed", "the path leaves the endpoint's target_url")
    if request.method not in endpoint.methods:
        raise ApiError(405, "method_not_allowed",
                       f"{endpoint.id!r} accepts {', '.join(endpoint.methods)}",
                       {"Allow": ", ".join(endpoint.methods)})
    priority, max_wait_s, cost, idem = _queue_headers(request)
    if priority > caller.max_priority:
        raise ApiError(403, "priority_not_allowed", f"priority {priority} exceeds this key's "
                       f"max_priority {caller.max_priority}")
    body = await read_limited(request, rt.settings.max_body_bytes)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    call = ProxyCall(rt, caller, endpoint, request.method, url, _forwarded(request), body,
                     priority, max_wait_s, cost, idem, gone, path=(rest, query))
    if tracing.ENABLED:
        call.trace = tracing.ProxyTrace(request.headers, request.method, url, endpoint.id)
    # Until its answer is relayed its task may wait in line (again, after an upstream's
    # pause): this process's marker for the endpoint says its caller is still held here.
    owners = rt.owners
    owners.hold(endpoint.id)
    try:
        await call.submit()
        while True:
            await call.wait_turn()
            answer = await call.call()
            if answer is not None:
                return RelayResponse(call, answer)  # it ends the span with the relay
    except CallerGone:
        call.traced(None, CALLER_LOST)
        return Response(status_code=499)  # nobody reads it
    except BaseException as exc:
        call.abandon()
        if call.task_id and not call.token and _left_in_line(exc):
            # Withdrawn now, rather than left for a dispatcher to admit for nobody, holding a
            # slot until its lease lapses.
            await _withdrawn(call)
            if isinstance(exc, asyncio.CancelledError) and rt.draining:
                # The server cancels the requests still running when a shutdown's grace ends:
                # never called, it may be sent again, to a process that stays, rather than
                # read as the gateway's fault.
                exc = ApiError(503, "shutting_down", "this gateway process is shutting down: "
                               "the request left its line uncalled; send it again",
                               {"Retry-After": "1"}, task_id=call.task_id)
                call.traced(exc.status, exc.message)
                raise exc from None
        if isinstance(exc, ApiError):
            call.traced(exc.status, exc.message if exc.status >= 500 else None)
        else:
            call.traced(None, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        owners.release(endpoint.id)
        if not call.token:  # no answer to relay: nothing watches the caller any more
            gone.cancel()


async def proxy_fast(request: Request) -> Response:
    """The same, from the fast lane (app/routes/fastlane.py): most of a proxied request's
    CPU went to the router's trying every route and FastAPI's per-request work."""
    params = request.path_params
    return await proxy(request, params["endpoint_id"], params["path"])


for _method in METHODS:  # one operation a method: each its own id in the OpenAPI document
    router.add_api_route("/proxy/{endpoint_id}/{path:path}", proxy, methods=[_method],
                         responses=ERRORS, operation_id=f"proxy_{_method.lower()}",
                         response_class=Response)


def _left_in_line(exc: BaseException) -> bool:
    """Whether `exc` may leave the request's task in line with nobody waiting on it: anything
    but the gateway's own answers (a shutdown cancels the requests still waiting when its grace
    ends; an unexpected error), and the 503 of a submit queued on the master that its replicas
    did not confirm in time (the others end the task, or come before it exists)."""
    return not isinstance(exc, ApiError) or exc.code == "redis_unavailable"


async def _withdrawn(call: ProxyCall) -> None:
    """`call.withdraw()`, however this request's task was stopped (a cancel waits for it:
    once, within the Redis timeout), its errors logged: the request's own error goes on."""
    try:
        await asyncio.wait_for(asyncio.shield(call.withdraw()),
                               call.rt.settings.redis_timeout_s)
    except Exception as exc:
        log.warning("could not withdraw a proxied request cut short: %s", exc,
                    extra={"task_id": call.task_id, "endpoint": call.endpoint.id})


def _rest(request: Request, endpoint_id: str) -> str | None:
    """The path after /proxy/{endpoint_id}, as the caller sent it (percent-escapes kept:
    an encoded slash must be seen as one, not decoded into a separator); None when the id
    was sent escaped (`/proxy/ll%6D/...`): what follows it cannot be told apart safely."""
    scope = request.scope
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1").split("?", 1)[0]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    prefix = f"/proxy/{endpoint_id}/"
    return path[len(prefix):] if path.startswith(prefix) else None


def _queue_headers(request: Request) -> tuple[int, float, int, str | None]:
    h = request.headers
    priority = _number(h.get("x-queue-priority"), "X-Queue-Priority", 0, 0, MAX_PRIORITY)
    max_wait = _number(h.get("x-queue-max-wait"), "X-Queue-Max-Wait", DEFAULT_MAX_WAIT_S,
                       0.001, MAX_WAIT_S, whole=False)
    cost = _number(h.get("x-queue-cost"), "X-Queue-Cost", 1, 1, 10**9)
    idem = h.get("idempotency-key")
    if idem is not None and not IDEM_KEY.match(idem):
        raise ApiError(400, "invalid_idempotency_key",
                       "Idempotency-Key must be 1-128 visible ASCII characters")
    return int(priority), float(max_wait), int(cost), idem


def _number(raw: str | None, name: str, default: float, low: float, high: float,
            whole: bool = True) -> float:
    if raw is None:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise ApiError(400, "invalid_header", f"{name} must be a {'whole ' if whole else ''}"
                       f"number from {low:g} to {high:g}")
    return value


def _forwarded(request: Request) -> list[tuple[str, str]]:
    """The caller's headers the upstream gets: all but the gateway's own and hop-by-hop ones
    (and any the caller's Connection header names)."""
    named = {v.strip().lower() for v in request.headers.get("connection", "").split(",")}
    out = []
    for raw_name, raw_value in request.headers.raw:
        name = raw_name.decode("latin-1").lower()
        if name in _KEPT or name in named or name.startswith("x-queue-"):
            continue
        out.append((raw_name.decode("latin-1"), raw_value.decode("latin-1")))
    return out


async def _until_disconnect(receive: Receive) -> Any:
    while (await receive())["type"] != "http.disconnect":
        pass
