"""Public task routes: submit, status, cancel (docs/api.md)."""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from app import tracing
from app.auth import api_key, runtime, runtime_of
from app.core.keys import TASK_ID, endpoint_of
from app.errors import ApiError
from app.metrics import SUBMIT_LATENCY, SUBMIT_REJECTED
from app.models import (
    CancelResponse,
    CompleteRequest,
    ErrorResponse,
    SubmitRequest,
    SubmitResponse,
    TaskView,
)
from app.queue.events import next_change
from app.routes.body import body_schema, parse, read_limited
from app.routes.large import LARGE, large_answer
from app.runtime import Runtime
from app.store import ApiKey
from app.webhooks import allowed

router = APIRouter(prefix="/api/v1", tags=["tasks"])
AUTHORITY = re.compile(r"^[^:/?#]*://([^/?#]*)")
IDEM_KEY = re.compile(r"^[\x21-\x7e]{1,128}$")
MAX_WAIT_S = 30  # the longest a status read may hold for a change (`?wait=`)
ERRORS: dict[int | str, dict[str, object]] = {
    c: {"model": ErrorResponse} for c in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}
Caller = Annotated[ApiKey, Depends(api_key)]
Rt = Annotated[Runtime, Depends(runtime)]
# Submit and status resolve their caller themselves: FastAPI's dependency machinery costs
# about as much as the handler's own work on these hot paths. The OpenAPI document still
# declares the key requirement (app/openapi.py).


_IDEM = {"name": "Idempotency-Key", "in": "header", "required": False,
         "schema": {"type": "string", "maxLength": 128}}


@router.post("/tasks", status_code=202, response_model=SubmitResponse, responses=ERRORS,
             operation_id="submit_task",
             openapi_extra={**body_schema(SubmitRequest), "parameters": [_IDEM]})
async def submit(request: Request) -> JSONResponse:
    """Queue a request for a registered endpoint."""
    try:
        return await _submit(request)
    except ApiError as exc:  # counted by reason: what operators see refused, and why
        SUBMIT_REJECTED.labels(exc.code).inc()
        raise


async def _submit(request: Request) -> JSONResponse:
    started = time.perf_counter()
    caller, rt = api_key(request), runtime_of(request)
    idempotency_key = request.headers.get("idempotency-key")
    req = parse(SubmitRequest, await read_limited(request, rt.settings.max_body_bytes))
    if "@" in req.target_url and _has_userinfo(req.target_url):
        raise ApiError(422, "credentials_not_allowed",
                       "target_url must not carry user:password@; calls go to the registered "
                       "endpoint, with no credentials from the caller")
    endpoint = rt.registry.match(req.target_url)
    if endpoint is None or not endpoint.enabled:
        raise ApiError(404, "endpoint_not_registered",
                       "target_url matches no registered, enabled endpoint")
    if req.http_method not in endpoint.methods:
        raise ApiError(422, "method_not_allowed",
                       f"{endpoint.id!r} accepts {', '.join(endpoint.methods)}")
    if req.priority > caller.max_priority:
        raise ApiError(403, "priority_not_allowed",
                       f"priority {req.priority} exceeds this key's max_priority "
                       f"{caller.max_priority}")
    if req.callback_url is not None and not allowed(req.callback_url, caller.callback_urls):
        raise ApiError(422, "callback_not_allowed",
                       "callback_url must lie under one of this key's callback_urls")
    if idempotency_key is not None and not IDEM_KEY.match(idempotency_key):
        raise ApiError(400, "invalid_idempotency_key",
                       "Idempotency-Key must be 1-128 visible ASCII characters")
    if tracing.ENABLED:  # the caller's trace context in, the submit span's stored
        with tracing.submit_span(request.headers, req.headers, "/api/v1/tasks") as span:
            result = await rt.queue.submit(caller, endpoint, req, idempotency_key)
            span.set_attribute("qgw.endpoint", endpoint.id)
            if not isinstance(result, str):
                span.set_attribute("qgw.task_id", result.task_id)
    else:
        result = await rt.queue.submit(caller, endpoint, req, idempotency_key)
    if isinstance(result, str):  # a repeat: answer with the first task
        view = await _first_task(rt, caller.user_id, result)
        result = SubmitResponse(task_id=view.task_id, task_status=view.task_status,
                                created_at=view.created_at, wait_num=view.wait_num,
                                wait_time=view.wait_time)
    SUBMIT_LATENCY.labels(endpoint.id).observe(time.perf_counter() - started)
    return JSONResponse({"task_id": result.task_id, "task_status": result.task_status.value,
                         "created_at": result.created_at, "wait_num": result.wait_num,
                         "wait_time": result.wait_time}, 202)


def _has_userinfo(url: str) -> bool:
    authority = AUTHORITY.match(url)
    return authority is not None and "@" in authority[1]


async def _first_task(rt: Runtime, user_id: int, task_id: str) -> TaskView:
    """The task a repeated Idempotency-Key made, without delivering it (the answer carries no
    result); 409 naming it if it has finished, been read and let go since."""
    try:
        return await rt.queue.status(user_id, task_id, rt.registry.get(endpoint_of(task_id)),
                                     deliver=False)
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise ApiError(409, "duplicate_request",
                       f"this Idempotency-Key made task {task_id!r}, which has finished and "
                       "was delivered", task_id=task_id) from None


def _checked(task_id: str) -> str:
    if not TASK_ID.match(task_id):
        raise ApiError(404, "task_not_found", f"no task {task_id!r}")
    return task_id


@router.get("/tasks/{task_id}", response_model=TaskView, responses=ERRORS, operation_id="get_task")
async def status(
    request: Request, task_id: str,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S,
                                 description="hold until the status changes")] = 0,
) -> Response:
    """A task's status, place in line, estimated wait and result."""
    return await _status(request, task_id, wait)


async def status_fast(request: Request) -> Response | None:
    """`status` in the fast lane (app/routes/fastlane.py) for its usual forms, no query or a
    plain `wait` in range; any other is left to the route above, to be validated as ever."""
    wait = 0.0
    if request.scope["query_string"]:
        params = request.query_params
        raw = params.get("wait", "") if len(params) == 1 else ""
        if not raw.isascii():  # float() reads other scripts' digits; the route does not
            return None
        try:
            wait = float(raw)
        except ValueError:
            return None
        if not 0 <= wait <= MAX_WAIT_S:
            return None
    return await _status(request, request.path_params["task_id"], wait)


async def _status(request: Request, task_id: str, wait: float) -> Response:
    caller, rt = api_key(request), runtime_of(request)
    tid = _checked(task_id)
    endpoint = rt.registry.get(tid.partition(".")[2])
    read = partial(rt.queue.status, caller.user_id, tid, endpoint, result_limit=LARGE)
    if wait > 0:  # woken by the scripts' status events, not by polling Redis
        view = await next_change(rt.events, tid, read, wait)
    else:
        view = await read()
    if view.result_left_out:  # megabytes inline: a large read (app/routes/large.py)
        return await large_answer(rt, caller, endpoint, view)
    return JSONResponse(view.model_dump(mode="json"))


@router.post("/tasks/{task_id}/cancel", response_model=CancelResponse, responses=ERRORS,
             operation_id="cancel_task")
async def cancel(task_id: str, caller: Caller, rt: Rt) -> CancelResponse:
    """Cancel a pending task, or an admitted online one."""
    status = await rt.queue.cancel(caller.user_id, _checked(task_id))
    return CancelResponse(task_id=task_id, task_status=status)


@router.post("/tasks/{task_id}/complete", response_model=CancelResponse, responses=ERRORS,
             operation_id="complete_task",
             openapi_extra={"requestBody": {"required": False, "content": {
                 "application/json": {"schema": CompleteRequest.model_json_schema()}}}})
async def complete(request: Request, task_id: str, caller: Caller, rt: Rt) -> CancelResponse:
    """An admitted online task is done; optional body `{"task_result": "..."}`."""
    tid = _checked(task_id)
    raw = await read_limited(request, rt.settings.max_body_bytes)
    body = parse(CompleteRequest, raw) if raw.strip() else CompleteRequest()
    status = await rt.queue.complete(caller.user_id, tid, body.task_result)
    return CancelResponse(task_id=tid, task_status=status)
