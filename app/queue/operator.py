"""An operator's view of any user's task: show, cancel, retry, and purge of an endpoint's
pending tasks (`qgw tasks ...` and the admin routes of docs/api.md call the same functions).

Not hot paths: a task's owner is looked up first (one HGET), then the user's own logic runs
on their behalf, so an operator's cancel is exactly a user's cancel.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from typing import Any

from sqlalchemy import select

from app.core.keys import TASK_ID, endpoint_of
from app.core.loop import STORE_ERRORS
from app.core.registry import EndpointRegistry
from app.db import bounded
from app.errors import ApiError
from app.lifecycle.records import DEAD_LETTERS, fields_of, from_ms, to_ms
from app.lifecycle.results import T
from app.models import TaskStatus
from app.queue.fairness import PRIORITY_STEP, starvation_keys
from app.queue.tasks import TaskQueue

#: Tasks one purge script run cancels (it blocks Redis meanwhile: about a millisecond), and
#: runs at most per purge (ten million tasks; a queue refilled as fast as it empties ends too).
PURGE_BATCH, PURGE_ROUNDS = 1000, 10_000
_REQUEST = ("method", "url", "body", "headers", "query", "priority", "client_ts")


async def show(queue: TaskQueue, registry: EndpointRegistry, task_id: str) -> dict[str, Any]:
    """The status fields, plus `user_id`, `endpoint` and the request (while Redis holds it)."""
    e = endpoint_of(task_id)
    raw = await queue.redis.hmget(queue.keys.task(task_id), ["user_id", *_REQUEST])
    if raw[0] is None:  # Redis let it go: SQL keeps the ending (a dead letter's request too)
        row = await _row(queue, task_id)
        view = queue._view(task_id, fields_of(row), None, None, registry.get(e))
        return {**view.model_dump(mode="json"), "user_id": int(row.user_id), "endpoint": e,
                "request": _kept_request(row)}
    user_id = int(raw[0])
    view = await queue.status(user_id, task_id, registry.get(e), deliver=False)
    req = dict(zip(_REQUEST, raw[1:], strict=True))
    request = {"method": req["method"], "url": req["url"], "body": req["body"],
               "body_truncated": False, "headers": json.loads(req["headers"] or "{}"),
               "query_params": json.loads(req["query"] or "{}"),
               "priority": int(req["priority"] or 0),
               "timestamp": int(req["client_ts"]) if req["client_ts"] else None}
    return {**view.model_dump(mode="json"), "user_id": user_id, "endpoint": e,
            "request": request}


async def cancel(queue: TaskQueue, task_id: str) -> TaskStatus:
    """A user's cancel, for the task's owner: 409 naming the status if it already ended."""
    return await queue.cancel(await owner(queue, task_id), task_id)


def _arrivals(queue: TaskQueue, registry: EndpointRegistry, e: str) -> tuple[str, ...]:
    """The starvation index of the endpoint, if it has a bound: a task run again goes back
    into it at its first arrival (lua/includes/starvation.lua)."""
    endpoint = registry.get(e)
    return queue.keys.of(e, *starvation_keys(endpoint)) if endpoint is not None else ()


async def retry(queue: TaskQueue, registry: EndpointRegistry, task_id: str) -> dict[str, Any]:
    """A failed or expired task runs again, from its old place in its queue."""
    if not TASK_ID.match(task_id):  # not one of ours: no endpoint of it to talk about
        raise ApiError(404, "task_not_found", f"no task {task_id!r}")
    k, e = queue.keys, endpoint_of(task_id)
    res = await queue.scripts.requeue(
        keys=[k.task(task_id), k.queue(e), k.wake(e), k.outbox(e), k.delivered(e), k.live(e),
              k.deadlines(e), *_arrivals(queue, registry, e)],
        args=[task_id, e, queue.ttls.pending_ms, queue.ttls.done_ms],
    )
    if res[0] == "retried":
        await _forget_row(queue, task_id, from_ms(res[2]))
        return {"task_id": task_id, "task_status": TaskStatus.PENDING.value,
                "wait_num": int(res[1])}
    if res[0] == "gone":
        raise ApiError(409, "endpoint_not_registered",
                       f"the endpoint of task {task_id!r} is deleted; nothing would run it")
    if res[0] == "proxy":
        raise _proxied(task_id, str(res[1]))
    if res[0] == "conflict":
        raise ApiError(409, "task_not_retryable",
                       f"task {task_id!r} is {res[1]}; only a failed or expired task can be "
                       "retried", task_status=res[1])
    return await _revive(queue, registry, await _row(queue, task_id))  # 404 if unknown


def _proxied(task_id: str, status: str) -> ApiError:
    """A proxied request is answered on its caller's connection, gone by now: run again, its
    answer would reach nobody (and its caller may well have sent it again meanwhile)."""
    return ApiError(409, "proxy_not_retryable",
                    f"task {task_id!r} is a proxied request ({status}); its answer went to its "
                    "caller's connection, which is closed, so it cannot run again: the caller "
                    "sends it again", task_status=status, task_type="proxy")


def _kept_request(row: Any) -> dict[str, Any] | None:
    """A dead letter's request as its row keeps it (None for other endings)."""
    if not row.request:
        return None
    req = json.loads(row.request)
    return {"method": req["method"], "url": req["url"], "body": req["body"],
            "body_truncated": req["body_truncated"], "headers": req["headers"],
            "query_params": req["query"], "priority": int(row.priority or 0),
            "timestamp": int(req["client_ts"]) if req.get("client_ts") else None}


async def _revive(queue: TaskQueue, registry: EndpointRegistry, row: Any) -> dict[str, Any]:
    """Run again a dead letter only SQL holds, with its original request and priority."""
    task_id, e = str(row.task_id), str(row.endpoint)
    if row.type == "proxy":
        raise _proxied(task_id, str(row.status))
    if row.status not in DEAD_LETTERS:
        raise ApiError(409, "task_not_retryable",
                       f"task {task_id!r} is {row.status}; only a failed or expired task can "
                       "be retried", task_status=row.status)
    req = json.loads(row.request) if row.request else None
    if req is None or req["body_truncated"]:
        raise ApiError(409, "request_not_kept",
                       f"task {task_id!r} ({row.status}) is no longer held in Redis and its "
                       "request was not kept whole; submit it again", task_status=row.status)
    k, priority = queue.keys, int(row.priority or 0)
    fields: list[Any] = [
        "user_id", row.user_id, "type", row.type, "priority", priority, "method", req["method"],
        "url", req["url"], "body", req["body"], "headers", json.dumps(req["headers"]),
        "query", json.dumps(req["query"]), "client_ts", req.get("client_ts", ""),
        "arrived_at", to_ms(row.created_at) or "",  # its place by age (starvation.lua)
        "ended_before", to_ms(row.ended_at) or ""]  # its next ending comes after this one
    if row.created_at is not None:  # its submit, as a retry from Redis keeps it
        fields += ["created_at", to_ms(row.created_at)]
    if row.started_at is not None:  # its wait in line was counted at its first start
        fields += ["waited", 1]
    for name in ("cost", "callback_url", "key_id"):
        if name in req:
            fields += [name, req[name]]
    score = req.get("score") or -priority * PRIORITY_STEP
    res = await queue.scripts.revive(
        keys=[k.task(task_id), k.queue(e), k.wake(e), k.live(e), k.deadlines(e),
              *_arrivals(queue, registry, e)],
        args=[task_id, e, queue.ttls.pending_ms, queue.ttls.done_ms, score, *fields])
    if res[0] == "exists":  # retried meanwhile (or now in Redis again): Redis's copy decides
        return await retry(queue, registry, task_id)
    if res[0] == "gone":
        raise ApiError(409, "endpoint_not_registered",
                       f"the endpoint of task {task_id!r} is deleted; nothing would run it")
    await _forget_row(queue, task_id, row.ended_at)
    return {"task_id": task_id, "task_status": TaskStatus.PENDING.value, "wait_num": int(res[1])}


async def _forget_row(queue: TaskQueue, task_id: str, ended_at: datetime | None) -> None:
    """The old ending of a task running again (the one that ended at `ended_at`): it is no
    dead letter any more (its next ending writes the row anew). Best effort: a row left says
    `failed` until then. Only that ending's row goes: a delete abandoned by its bound may still
    land after the task has run and ended again, and must not take the new ending with it."""
    if queue.results is not None and ended_at is not None:
        with contextlib.suppress(*STORE_ERRORS):
            await bounded(queue.results.delete([task_id], ended_at=ended_at))


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
