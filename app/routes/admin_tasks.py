"""Admin routes over any user's tasks (docs/api.md, "Tasks, for operators"): look one up, list an
endpoint's by status, retry, cancel, and purge an endpoint's pending tasks (admin token)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from app.auth import admin, runtime
from app.errors import ApiError, expects
from app.models import TaskStatus
from app.queue import bulk, listing, operator, search
from app.queue.search import ID_PREFIX, TaskFilter, utc
from app.routes.admin import ERRORS
from app.routes.tasks import _checked
from app.runtime import Runtime

router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(admin)],
                   responses={**ERRORS, 503: ERRORS[409]})
Rt = Annotated[Runtime, Depends(runtime)]
Status = Literal["pending", "processing", "completed", "failed", "cancelled", "expired"]


def _known(rt: Runtime, endpoint_id: str) -> None:
    if rt.registry.get(endpoint_id) is None:
        raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")


def _iso_only(value: object) -> object:
    """A number is no time here: pydantic would read "0.5" as seconds since 1970, which the
    OpenAPI document (a date-time string) does not allow."""
    if isinstance(value, int | float) or (
            isinstance(value, str) and value.strip().lstrip("+-").replace(".", "", 1).isdigit()):
        raise ValueError("an ISO 8601 date-time is expected, e.g. 2026-11-25T10:00:00Z")
    return value


#: A time of the filter: ISO 8601 only.
IsoTime = Annotated[datetime, BeforeValidator(_iso_only)]


class TaskFilterIn(BaseModel):
    """The filter of a bulk retry or cancel (the search's query parameters, as JSON)."""

    model_config = ConfigDict(extra="forbid")
    status: Status | None = None
    endpoint: str | None = Field(None, min_length=1, max_length=64)
    since: IsoTime | None = None
    until: IsoTime | None = None
    id: str | None = Field(None, pattern=ID_PREFIX)

    def filter(self) -> TaskFilter:
        since, until = utc(self.since), utc(self.until)
        if since is not None and until is not None and since >= until:
            raise ApiError(422, "bad_filter", "since must come before until")
        return TaskFilter(self.status, self.endpoint, since, until, self.id)


@router.get("/tasks", operation_id="search_tasks")
async def search_tasks(
    rt: Rt, status: Status | None = None,
    endpoint: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
    since: IsoTime | None = None, until: IsoTime | None = None,
    id: Annotated[str | None, Query(pattern=ID_PREFIX)] = None,
    limit: Annotated[int, Query(ge=1, le=listing.MAX_LIMIT)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, pattern=r"^-?\d{1,19}:\S+$")] = None,
) -> dict[str, Any]:
    """Every endpoint's tasks: finished ones (any status, or the one named) newest ending
    first, filtered by endpoint, end time (`since` inclusive, `until` exclusive) and id
    prefix; pending or processing ones of one endpoint in dispatch order. Dead letters
    (`failed`, `expired`) carry their `last_error`. Pass `next_cursor` back as `cursor`."""
    f = TaskFilterIn(status=status, endpoint=endpoint, since=since, until=until, id=id)
    return await search.search(rt.queue, rt.registry, f.filter(), limit, cursor)


@router.post("/tasks/retry", operation_id="retry_tasks")
async def retry_tasks(body: TaskFilterIn, rt: Rt) -> dict[str, Any]:
    """Run again every dead letter the filter matches (`status` "failed" or "expired"), each
    with its original request and priority; answers how many matched and were retried (404
    when none matched)."""
    return await bulk.retry(rt.queue, rt.registry, body.filter())


@router.post("/tasks/cancel", operation_id="cancel_tasks")
async def cancel_tasks(body: TaskFilterIn, rt: Rt) -> dict[str, Any]:
    """Cancel every pending and running task the filter matches (`status` "pending",
    "processing" or none; times are when they were submitted); a running call is aborted.
    Answers how many matched and were cancelled (404 when none matched)."""
    return await bulk.cancel(rt.queue, rt.registry, body.filter())


@router.get("/tasks/{task_id}", operation_id="show_task")
async def show_task(task_id: str, rt: Rt) -> dict[str, Any]:
    """Any user's task: the status fields, `user_id`, `endpoint`, and its request while Redis
    holds it (null once only SQL has the task)."""
    return await operator.show(rt.queue, rt.registry, _checked(task_id))


@router.post("/tasks/{task_id}/retry", operation_id="retry_task")
async def retry_task(task_id: str, rt: Rt) -> dict[str, Any]:
    """A failed or expired task runs again from its old place in line (409 otherwise)."""
    return await operator.retry(rt.queue, rt.registry, _checked(task_id))


@router.post("/tasks/{task_id}/cancel", operation_id="cancel_any_task")
async def cancel_task(task_id: str, rt: Rt) -> dict[str, str]:
    """Cancel any user's task, as its owner would (409 with its status once it ended)."""
    await operator.cancel(rt.queue, _checked(task_id))
    return {"task_id": task_id, "task_status": TaskStatus.CANCELLED.value}


@router.get("/endpoints/{endpoint_id}/tasks", operation_id="list_endpoint_tasks")
async def list_endpoint_tasks(
    endpoint_id: str, rt: Rt, status: Status = "pending",
    limit: Annotated[int, Query(ge=1, le=listing.MAX_LIMIT)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, pattern=expects(
        r"^-?\d{1,19}:\S+$", "the next_cursor of a previous page"))] = None,
) -> dict[str, Any]:
    """A page of the endpoint's tasks of one status: pending in dispatch order (with each
    one's `wait_num`), processing by lease deadline, finished ones newest first. Pass
    `next_cursor` back as `cursor` for the next page (null: no more)."""
    _known(rt, endpoint_id)
    return await listing.list_tasks(rt.queue, endpoint_id, status, limit, cursor)


@router.post("/endpoints/{endpoint_id}/purge", operation_id="purge_endpoint")
async def purge_endpoint(endpoint_id: str, rt: Rt) -> dict[str, Any]:
    """Cancel every pending and running task of the endpoint (each as a user's cancel would:
    a running call is aborted); answers how many. Submits go on being accepted: pause or
    disable the endpoint to stop them."""
    _known(rt, endpoint_id)
    return {"endpoint": endpoint_id, "cancelled": await operator.purge(rt.queue, endpoint_id)}
