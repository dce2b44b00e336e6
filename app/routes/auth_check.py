"""`GET /auth/check`: the gateway check of online permits (nginx auth_request, Traefik
forwardAuth). The signature is verified in memory; one Redis script then checks the admission is
still live and counts the use. No SQL.

The request line being let through comes from headers the front gateway sets itself: nginx
(deploy/nginx/nginx.conf) sets X-Original-URI/-Method, Traefik always overwrites
X-Forwarded-Uri/-Method.
Each also passes on headers the client sent, so a client may add the other kind. With
`QGW_AUTH_CHECK_HEADERS=both` every such header present must name this endpoint: the one the
gateway set is always among them, so a client's own can refuse a call, never let one through.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.datastructures import Headers

from app import permits
from app.auth import runtime_of
from app.core.keys import TASK_ID, endpoint_of
from app.endpoints import EndpointConfig
from app.routes.errors import error_response

router = APIRouter(tags=["gateway"])
_NGINX = ("x-original-uri", "x-original-method")
_TRAEFIK = ("x-forwarded-uri", "x-forwarded-method")
SOURCES = {"nginx": (_NGINX,), "traefik": (_TRAEFIK,), "both": (_NGINX, _TRAEFIK)}


def _denied(message: str) -> Response:
    return error_response(403, "permit_denied", message)


@router.get("/auth/check", status_code=200, responses={401: {}, 403: {}},
            operation_id="auth_check")
async def check(request: Request) -> Response:
    """200 lets the call through; 401 when the permit headers are missing; 403 otherwise."""
    h = request.headers
    task_id, token = h.get("x-queue-task-id"), h.get("x-queue-permit")
    if not task_id or not token:
        return error_response(401, "permit_required",
                              "X-Queue-Task-Id and X-Queue-Permit are required")
    rt = runtime_of(request)
    if not TASK_ID.match(task_id):
        return _denied("unknown task")
    if not permits.verify(rt.settings.permit_key, task_id, token):
        return _denied("the permit is forged")
    endpoint = rt.registry.get(endpoint_of(task_id))
    if endpoint is None:
        return _denied("the permit's endpoint is gone")
    refused = _request_line_refused(h, SOURCES[rt.settings.auth_check_headers], endpoint)
    if refused:
        return _denied(refused)
    deadline = token.partition(".")[0]
    ok = await rt.queue.scripts.permit(keys=[rt.keys.task(task_id)],
                                       args=[deadline, endpoint.permit_max_uses])
    if ok == -1:  # on the Redis clock, which every replica shares
        return _denied("the permit has expired")
    if ok != 1:
        return _denied("the permit was revoked, has ended, or is used up")
    return Response(status_code=200)


def _request_line_refused(
    h: Headers, sources: tuple[tuple[str, str], ...], endpoint: EndpointConfig
) -> str | None:
    """Why the request line the front gateway reports is not one this permit covers, if so.

    Every value of every header read must pass (a repeated header too). The path is the
    request target up to its query, compared as it is: `//api/x` is a path, not a host.
    """
    uris = [v for uri, _ in sources for v in h.getlist(uri)]
    methods = [v for _, method in sources for v in h.getlist(method)]
    if not uris or not methods:
        names = " or ".join(f"{u} and {m}" for u, m in sources)
        return f"no request line: the front gateway must send {names}"
    path = endpoint.key[3]
    if any(uri.partition("?")[0] != path for uri in uris):
        return "the permit is for another endpoint"
    for method in methods:
        if method.upper() not in endpoint.methods:
            return f"{endpoint.id!r} does not take {method.upper()}"
    return None
