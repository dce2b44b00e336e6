"""An operator's view of any user's task: show, cancel, retry, and purge of an endpoint's
pending tasks (`qgw tasks ...` and the admin routes of docs/api.md call the same functions).

Not hot paths: a task's owner is looked up first (one HGET), then the user's own logic runs
on their behalf, so an operator's cancel is exactly a user's cancel.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from app.core.keys import TASK_ID, endpoint_of
from app.core.registry import EndpointRegistry
from app.db import bounded
from app.errors import ApiError
from app.lifecycle.records import fields_of
from app.lifecycle.results import T
from app.models import TaskStatus
from app.queue.tasks import TaskQueue

#: Tasks one purge script run cancels (it blocks Redis meanwhile: about a millisecond), and
#: runs at most per purge (ten million tasks; a queue refilled as fast as it empties ends too).
PURGE_BATCH, PURGE_ROUNDS = 1000, 10_000
_REQUEST = ("method", "url", "body", "headers", "query", "priority", "client_ts")


async def show(queue: TaskQueue, registry: EndpointRegistry, task_id: str) -> dict[str, Any]:
    """The status fields, plus `user_id`, `endpoint` and the request (while Redis holds it)."""
    e = endpoint_of(task_id)
    raw = await queue.redis.hmget(queue.keys.task(task_id), ["user_id", *_REQUEST])
    if raw[0] is None:  # Redis let it go: SQL keeps the ending, not the request
        row = await _row(queue, task_id)
        view = queue._view(task_id, fields_of(row), None, None, registry.get(e))
        return {**view.model_dump(mode="json"), "user_id": int(row.user_id), "endpoint": e,
                "request": None}
    user_id = int(raw[0])
    view = await queue.status(user_id, task_id, registry.get(e), deliver=False)
    req = dict(zip(_REQUEST, raw[1:], strict=True))
    request = {"method": req["method"], "url": req["url"], "body": req["body"],
               "headers": json.loads(req["headers"] or "{}"),
               "query_params": json.loads(req["query"] or "{}"),
               "priority": int(req["priority"] or 0),
               "timestamp": int(req["client_ts"]) if req["client_ts"] else None}
    return {**view.model_dump(mode="json"), "user_id": user_id, "endpoint": e,
            "request": request}


async def cancel(queue: TaskQueue, task_id: str) -> TaskStatus:
    """A user's cancel, for the task's owner: 409 naming the status if it already ended."""
    return await queue.cancel(await owner(queue, task_id), task_id)


async def retry(queue: TaskQueue, task_id: str) -> dict[str, Any]:
    """A failed or expired task runs again, from its old place in its queue."""
    if not TASK_ID.match(task_id):  # not one of ours: no endpoint of it to talk about
        raise ApiError(404, "task_not_found", f"no task {task_id!r}")
    k, e = queue.keys, endpoint_of(task_id)
    res = await queue.scripts.requeue(
        keys=[k.task(task_id), k.queue(e), k.wake(e), k.outbox(e), k.delivered(e), k.live(e)],
        args=[task_id, e, queue.ttls.pending_ms, queue.ttls.done_ms],
    )
    if res[0] == "retried":
        return {"task_id": task_id, "task_status": TaskStatus.PENDING.value,
                "wait_num": int(res[1])}
    if res[0] == "gone":
        raise ApiError(409, "endpoint_not_registered",
                       f"the endpoint of task {task_id!r} is deleted; nothing would run it")
    if res[0] == "conflict":
        raise ApiError(409, "task_not_retryable",
                       f"task {task_id!r} is {res[1]}; only a failed or expired task can be "
                       "retried", task_status=res[1])
    row = await _row(queue, task_id)  # 404 if unknown
    raise ApiError(409, "task_not_retryable",
                   f"task {task_id!r} ({row.status}) is no longer held in Redis and its request "
                   "is gone; submit it again", task_status=row.status)


async def purge(queue: TaskQueue, endpoint_id: str) -> int:
    """Cancel every pending task of the endpoint, a batch per script run, then every one
    running (their calls are aborted: cancel-9.lua); returns how many."""
    k, e, total = queue.keys, endpoint_id, 0
    for _ in range(PURGE_ROUNDS):
        cancelled, more = await queue.scripts.purge(
            keys=k.of(e, "queue", "retry", "stats", "outbox", "hooks"),
            args=[k.task_prefix(e), PURGE_BATCH])
        total += int(cancelled)
        if not int(more):
            break
    # Running tasks are few (the endpoint's slots): one cancel each, as their owner's.
    for task_id in [str(t) for t in await queue.redis.zrange(k.active(e), 0, -1)]:
        total += await _cancel_quietly(queue, task_id)
    return total


async def _cancel_quietly(queue: TaskQueue, task_id: str) -> int:
    """1 if this cancelled the task, 0 if it had ended meanwhile (or was gone)."""
    try:
        await cancel(queue, task_id)
    except ApiError as exc:
        if exc.status in (404, 409):
            return 0
        raise
    return 1


async def owner(queue: TaskQueue, task_id: str) -> int:
    uid = await queue.redis.hget(queue.keys.task(task_id), "user_id")
    if uid is not None:
        return int(uid)
    return int((await _row(queue, task_id)).user_id)


async def _row(queue: TaskQueue, task_id: str) -> Any:
    """The SQL row of a finished task Redis has let go, whoever's it is; 404 without one."""
    row = None
    if queue.results is not None:
        async def get() -> Any:
            assert queue.results is not None
            async with queue.results.engine.connect() as conn:
                return (await conn.execute(select(T).where(T.c.task_id == task_id))).first()

        row = await bounded(get())
    if row is None:
        raise ApiError(404, "task_not_found", f"no task {task_id!r}")
    return row
