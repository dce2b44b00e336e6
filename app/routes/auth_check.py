"""`GET /auth/check`: the gateway check of online permits (nginx auth_request, Traefik
forwardAuth). The signature is verified in memory; one Redis script then checks the admission is
still live and counts the use. No SQL."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from fastapi import APIRouter, Request, Response

from app import permits
from app.auth import runtime_of
from app.errors import error_response
from app.queue.keys import endpoint_of
from app.routes.tasks import TASK_ID

router = APIRouter(tags=["gateway"])


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
    if not permits.verify(rt.settings.permit_key, task_id, token, int(time.time() * 1000)):
        return _denied("the permit is forged or expired")
    endpoint = rt.registry.get(endpoint_of(task_id))
    if endpoint is None:
        return _denied("the permit's endpoint is gone")
    uri = h.get("x-original-uri") or h.get("x-forwarded-uri")
    if uri is not None and (urlsplit(uri).path or "/") != endpoint.key[3]:
        return _denied("the permit is for another endpoint")
    method = h.get("x-original-method") or h.get("x-forwarded-method")
    if method is not None and method.upper() not in endpoint.methods:
        return _denied(f"{endpoint.id!r} does not take {method.upper()}")
    deadline = token.partition(".")[0]
    ok = await rt.queue.scripts.permit(keys=[rt.keys.task(task_id)],
                                       args=[deadline, endpoint.permit_max_uses])
    if not ok:
        return _denied("the permit was revoked, has ended, or is used up")
    return Response(status_code=200)
