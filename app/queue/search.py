"""An operator's search of every endpoint's tasks (`GET /admin/v1/tasks`): by status, endpoint,
time range and id prefix, newest first, a page at a time; the walk the bulk retry and cancel
take (app/queue/bulk.py).

Finished tasks come from SQL, each status through an index (status, ended_at), or (endpoint,
status, ended_at) with an endpoint: one query per status asked, merged here, so a page reads
`limit + 1` rows of each and never scans the table (bench/search.py measures it). The endings
still waiting in the outbox for SQL are merged in, as the per-endpoint list does
(app/queue/listing.py). Pending and processing tasks live in Redis in dispatch order: they are
listed per endpoint (that list), not searched.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, null, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.core.loop import STORE_ERRORS
from app.core.registry import EndpointRegistry
from app.db import bounded
from app.errors import ApiError
from app.lifecycle.records import DEAD_LETTERS, from_ms, to_ms
from app.lifecycle.results import T
from app.queue import listing
from app.queue.listing import Cursor
from app.queue.tasks import TaskQueue

FINISHED = ("completed", "failed", "cancelled", "expired")
ERROR_CHARS = 200  # of a dead letter's last error, in a list


@dataclass(frozen=True, slots=True)
class TaskFilter:
    """What a search (and a bulk retry or cancel) takes: None matches anything. Times are
    naive UTC; a finished task is matched by when it ended, a live one by when it was
    submitted."""

    status: str | None = None
    endpoint: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    id_prefix: str | None = None

    @property
    def empty(self) -> bool:
        return not any((self.status, self.endpoint, self.since, self.until, self.id_prefix))

    def matches(self, task_id: str, at: datetime | None) -> bool:
        """The filter's time range and id prefix (status and endpoint are the caller's)."""
        if self.id_prefix and not task_id.startswith(self.id_prefix):
            return False
        if at is None:
            return self.since is None and self.until is None
        return ((self.since is None or at >= self.since)
                and (self.until is None or at < self.until))


#: An id prefix: what a task id is made of (hex, then a dot and the endpoint id). No wildcard
#: of SQL's LIKE or SQLite's GLOB passes it (from_sql matches prefixes with them).
ID_PREFIX = r"^[0-9a-z._-]{1,97}$"


def utc(dt: datetime | None) -> datetime | None:
    """A time as SQL keeps them: naive UTC (a naive one given is taken as UTC); one whose UTC
    falls outside what a datetime holds (year 1 at +05:00) is the first or last there is."""
    if dt is None or dt.tzinfo is None:
        return dt
    try:
        return dt.astimezone(UTC).replace(tzinfo=None)
    except OverflowError:
        return datetime.min if dt.year == 1 else datetime.max


async def search(queue: TaskQueue, registry: EndpointRegistry, f: TaskFilter, limit: int,
                 cursor: str | None) -> dict[str, Any]:
    after = Cursor.parse(cursor)
    if f.status in listing.LIVE:
        if f.endpoint is None or f.since or f.until or f.id_prefix:
            raise ApiError(422, "bad_filter",
                           f"{f.status} tasks are listed per endpoint in dispatch order: give "
                           "an endpoint and no time range or id prefix")
        if registry.get(f.endpoint) is None:
            raise ApiError(404, "endpoint_not_found", f"no endpoint {f.endpoint!r}")
        page = await listing.list_tasks(queue, f.endpoint, f.status, limit, cursor)
        for t in page["tasks"]:
            t["endpoint"] = f.endpoint
        return {"tasks": page["tasks"], "next_cursor": page["next_cursor"]}
    return await finished(queue, registry, f, limit, after)


async def finished(queue: TaskQueue, registry: EndpointRegistry, f: TaskFilter, limit: int,
                   after: Cursor | None) -> dict[str, Any]:
    """A page of finished tasks matching `f`, newest ending first."""
    statuses = [f.status] if f.status else list(FINISHED)
    endpoints = [f.endpoint] if f.endpoint else [e.id for e in registry.all()]
    found: dict[str, dict[str, Any]] = {}
    for e in endpoints:
        for tid, fields in (await _from_outbox(queue, e, statuses, f, after)).items():
            found[tid] = {**fields, "endpoint": e}
    database = "ok"
    try:
        rows = (await bounded(from_sql(queue.results.engine, statuses, f, limit, after))
                if queue.results is not None else {})
        found.update({tid: r for tid, r in rows.items() if tid not in found})
    except STORE_ERRORS:
        database = "unavailable"
    order = sorted(found, key=lambda tid: (int(found[tid]["ended_at"] or 0), tid), reverse=True)
    page = order[:limit]
    last = page[-1] if page else None
    return {"database": database, "tasks": [_item(tid, found[tid]) for tid in page],
            "next_cursor": (str(Cursor(int(found[last]["ended_at"] or 0), last))
                            if last and len(order) > limit else None)}


def _item(task_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    item = {**listing._item(task_id, fields), "endpoint": fields["endpoint"]}
    if fields.get("status") in DEAD_LETTERS:
        item["last_error"] = (fields.get("result") or "")[:ERROR_CHARS] or None
    return item


async def _from_outbox(queue: TaskQueue, e: str, statuses: Collection[str], f: TaskFilter,
                       after: Cursor | None) -> dict[str, dict[str, Any]]:
    """Endings of these statuses SQL may not have yet (the newest OUTBOX_SCAN)."""
    k, r = queue.keys, queue.redis
    top = after.at if after else "+inf"
    ids = [str(i) for i in await r.zrevrangebyscore(k.outbox(e), top, "-inf", start=0,
                                                     num=listing.OUTBOX_SCAN)]
    if not ids:
        return {}
    async with r.pipeline(transaction=False) as pipe:
        for tid in ids:
            pipe.hmget(k.task(tid), listing._FIELDS)
        rows = await pipe.execute()
    out = {}
    for tid, values in zip(ids, rows, strict=True):
        fields = dict(zip(listing._FIELDS, values, strict=True))
        ended = int(fields["ended_at"] or 0)
        if (fields["status"] in statuses and listing._before(ended, tid, after)
                and f.matches(tid, from_ms(ended))):
            out[tid] = fields
    dead = [tid for tid, fields in out.items() if fields["status"] in DEAD_LETTERS]
    if dead:  # their last error (a completed task's result may be megabytes: not read)
        async with r.pipeline(transaction=False) as pipe:
            for tid in dead:
                pipe.hget(k.task(tid), "result")
            for tid, result in zip(dead, await pipe.execute(), strict=True):
                out[tid]["result"] = result
    return out


async def from_sql(engine: AsyncEngine, statuses: list[str], f: TaskFilter, limit: int,
                   after: Cursor | None) -> dict[str, dict[str, Any]]:
    """Each status through its index, `limit + 1` rows each: the page is among them."""
    out: dict[str, dict[str, Any]] = {}
    async with engine.connect() as conn:
        for status in statuses:
            q = _query(status, f, limit, after, conn.dialect.name)
            for row in (await conn.execute(q)).all():
                out[row.task_id] = {
                    "user_id": row.user_id, "status": row.status, "type": row.type,
                    "priority": row.priority, "attempts": row.attempts,
                    "created_at": to_ms(row.created_at), "started_at": to_ms(row.started_at),
                    "ended_at": to_ms(row.ended_at), "result_status_code": row.result_status_code,
                    "endpoint": row.endpoint, "result": row.error}
    return out


def _query(status: str, f: TaskFilter, limit: int, after: Cursor | None, dialect: str) -> Any:
    # A dead letter's last error, cut short; no result read for the others (megabytes).
    error = func.substr(T.c.result, 1, ERROR_CHARS) if status in DEAD_LETTERS else null()
    q = select(T.c.task_id, T.c.user_id, T.c.endpoint, T.c.type, T.c.status, T.c.priority,
               T.c.attempts, T.c.created_at, T.c.started_at, T.c.ended_at,
               T.c.result_status_code, error.label("error"))
    # With an id prefix the primary key narrows most: the status (and endpoint) are then
    # compared through coalesce(), which no index serves, or SQLite, with no statistics
    # (nobody runs ANALYZE), would walk every row of the status instead.
    def col(c: Any) -> Any:
        return func.coalesce(c, "") if f.id_prefix else c

    q = q.where(col(T.c.status) == status)
    if f.endpoint is not None:
        q = q.where(col(T.c.endpoint) == f.endpoint)
    if f.since is not None:
        q = q.where(T.c.ended_at >= f.since)
    if f.until is not None:
        q = q.where(T.c.ended_at < f.until)
    if f.id_prefix:
        # Index-friendly prefix match: SQLite's LIKE ignores case and so its index; GLOB
        # does not. The prefix holds no wildcard of either (its pattern: [0-9a-z._-]).
        q = q.where(T.c.task_id.op("GLOB")(f.id_prefix + "*") if dialect == "sqlite"
                    else T.c.task_id.like(f.id_prefix.replace("_", r"\_") + "%", escape="\\"))
    if after is not None:
        try:  # a cursor of the Redis lists may lie outside what a datetime holds
            at = from_ms(after.at)
        except (OverflowError, ValueError):
            raise ApiError(422, "bad_cursor", "cursor must be a next_cursor this route gave"
                           ) from None
        # `ended_at <= at` on its own bounds the index range: with only the OR, SQLite walks
        # the status's rows from the newest down to the cursor (bench/search.py: 8x slower
        # a few pages in).
        q = q.where(T.c.ended_at <= at, or_(T.c.ended_at < at, T.c.task_id < after.task_id))
    return q.order_by(T.c.ended_at.desc(), T.c.task_id.desc()).limit(limit + 1)
