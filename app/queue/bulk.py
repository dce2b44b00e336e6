"""An operator's bulk retry and cancel (`POST /admin/v1/tasks/retry|cancel`): every task a
filter matches (app/queue/search.py), each as the one-task route would do it
(app/queue/operator.py); answers how many matched and how many changed.

Not atomic across tasks: each task is its own script run, so a task that ends or is retried
meanwhile is counted under what happened to it. A filter that matches nothing is a 404, so a
typo in an endpoint or a status does not read as "done".
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from app.core.registry import EndpointRegistry
from app.errors import ApiError
from app.lifecycle.records import DEAD_LETTERS, from_ms
from app.queue import operator, search
from app.queue.listing import Cursor
from app.queue.search import TaskFilter
from app.queue.tasks import TaskQueue

MAX_TASKS = 100_000  # one bulk request changes at most this many (run it again for more)
PAGE = 200
AT_ONCE = 32  # scripts in flight at once


async def retry(queue: TaskQueue, registry: EndpointRegistry, f: TaskFilter) -> dict[str, Any]:
    """Run again every dead letter `f` matches, newest first, with its original request."""
    if f.status not in DEAD_LETTERS:
        raise ApiError(422, "bad_filter", "a bulk retry takes status 'failed' or 'expired'")
    if f.endpoint is not None and registry.get(f.endpoint) is None:
        raise ApiError(409, "endpoint_not_registered",
                       f"the endpoint {f.endpoint!r} is deleted; nothing would run its tasks")
    matched, outcomes = 0, Counter[str]()
    after: Cursor | None = None
    while matched < MAX_TASKS:
        page = await search.finished(queue, registry, f, PAGE, after)
        if page["database"] != "ok":
            raise ApiError(503, "database_unavailable", "dead letters are in SQL, which is "
                           "unavailable; retry shortly", {"Retry-After": "5"})
        ids = [t["task_id"] for t in page["tasks"]][:MAX_TASKS - matched]
        matched += len(ids)
        outcomes.update(await _each(ids, lambda tid: operator.retry(queue, registry, tid)))
        if page["next_cursor"] is None:
            break
        after = Cursor.parse(page["next_cursor"])
    return _answer(f, matched, outcomes, "retried")


async def cancel(queue: TaskQueue, registry: EndpointRegistry, f: TaskFilter) -> dict[str, Any]:
    """Cancel every pending and running task `f` matches (a running call is aborted)."""
    if f.empty:  # never "everything": an operator must say what to cancel
        raise ApiError(422, "bad_filter", "a bulk cancel needs a filter (endpoint, status, "
                       "since, until or id); an empty one would cancel every task")
    if f.status not in (None, "pending", "processing"):
        raise ApiError(422, "bad_filter",
                       "a bulk cancel takes status 'pending' or 'processing' (or none: both)")
    if f.endpoint is not None and registry.get(f.endpoint) is None:
        raise ApiError(404, "endpoint_not_found", f"no endpoint {f.endpoint!r}")
    endpoints = [f.endpoint] if f.endpoint else [e.id for e in registry.all()]
    ids: list[str] = []
    for e in endpoints:
        ids += await _live(queue, e, f, MAX_TASKS - len(ids))
    outcomes = await _each(ids, lambda tid: operator.cancel(queue, tid))
    return _answer(f, len(ids), outcomes, "cancelled")


async def _live(queue: TaskQueue, e: str, f: TaskFilter, room: int) -> list[str]:
    """The endpoint's pending (in line or waiting out a back-off) and running tasks that
    `f` matches, at most `room`."""
    k, r = queue.keys, queue.redis
    sets = {"pending": (k.queue(e), k.retry(e)), "processing": (k.active(e),)}
    keys = [key for status, ks in sets.items() if f.status in (None, status) for key in ks]
    ids: list[str] = []
    for key in keys:
        if len(ids) >= room:
            break
        ids += [str(t) for t in await r.zrange(key, 0, room - len(ids) - 1)]
    if f.since is None and f.until is None:
        return [tid for tid in ids if f.matches(tid, None)]
    async with r.pipeline(transaction=False) as pipe:
        for tid in ids:
            pipe.hget(k.task(tid), "created_at")
        created = await pipe.execute()
    return [tid for tid, at in zip(ids, created, strict=True) if f.matches(tid, from_ms(at))]


async def _each(ids: list[str], act: Any) -> Counter[str]:
    """Run `act` on each id, AT_ONCE at a time; what came of each: 'ok' or an error code."""
    out: Counter[str] = Counter()
    for i in range(0, len(ids), AT_ONCE):
        results = await asyncio.gather(*(act(tid) for tid in ids[i:i + AT_ONCE]),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, ApiError):
                out[res.code] += 1
            elif isinstance(res, BaseException):
                raise res
            else:
                out["ok"] += 1
    return out


def _answer(f: TaskFilter, matched: int, outcomes: Counter[str], verb: str) -> dict[str, Any]:
    if not matched:
        raise ApiError(404, "no_tasks_match", "no task matches this filter; nothing changed")
    changed = outcomes.pop("ok", 0)
    return {"matched": matched, verb: changed, "skipped": dict(outcomes),
            "more": matched >= MAX_TASKS}
