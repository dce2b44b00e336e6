"""An operator's list of one endpoint's tasks of one status, a page at a time
(`GET /admin/v1/endpoints/{id}/tasks`).

Pending tasks come from the queue in dispatch order, processing ones from the active set
(soonest lease deadline first): a cursor names the last task shown by its score and id, so a
page never repeats or skips a task as the queue moves (an offset would). Finished tasks come
from SQL (index by endpoint, status and end, migration 0007), newest first, together with the
ones still waiting in the endpoint's outbox for SQL: with the database down, the list is what
Redis holds, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, or_, select

from app.core.loop import STORE_ERRORS
from app.db import bounded
from app.errors import ApiError
from app.lifecycle.records import from_ms, to_ms
from app.lifecycle.results import T
from app.models import TaskStatus
from app.queue.tasks import TaskQueue
from app.timefmt import rfc3339

MAX_LIMIT = 200
#: Tasks that share a score with the cursor's (lease deadlines in one millisecond) and are
#: still shown correctly after it; more than that in one millisecond are skipped.
TIES = 64
#: Outbox entries one page looks at (newest first): the backlog of an outage can be millions.
OUTBOX_SCAN = 1000
_FIELDS = ("user_id", "status", "type", "priority", "attempts", "created_at", "started_at",
           "ended_at", "result_status_code")
LIVE = (TaskStatus.PENDING.value, TaskStatus.PROCESSING.value)


MAX_AT = 253_402_300_800_000  # ms from the epoch to the year 10000


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the last page ended: a score (pending, processing) or an end time in ms."""

    at: int
    task_id: str

    @classmethod
    def parse(cls, raw: str | None) -> Cursor | None:
        if not raw:
            return None
        at, sep, task_id = raw.partition(":")
        # Scores and end times (ms) lie well inside both bounds: a Redis score is exact to
        # 2^53, and an end time must name a datetime (year 9999 at most) for the SQL query.
        if (not sep or not task_id or not (digits := at.lstrip("-")).isascii()
                or not digits.isdigit() or not task_id.isprintable()
                or not -MAX_AT < int(at) < MAX_AT):
            raise ApiError(422, "bad_cursor", "cursor must be a next_cursor this route gave")
        return cls(int(at), task_id)

    def __str__(self) -> str:
        return f"{self.at}:{self.task_id}"


async def list_tasks(queue: TaskQueue, endpoint_id: str, status: str, limit: int,
                     cursor: str | None) -> dict[str, Any]:
    after = Cursor.parse(cursor)
    if status in LIVE:
        page = await _live(queue, endpoint_id, status, limit, after)
    else:
        page = await _finished(queue, endpoint_id, status, limit, after)
    return {"endpoint": endpoint_id, "status": status, **page}


async def _live(queue: TaskQueue, e: str, status: str, limit: int, after: Cursor | None
                ) -> dict[str, Any]:
    k, r = queue.keys, queue.redis
    key = k.queue(e) if status == TaskStatus.PENDING.value else k.active(e)
    if after is None:
        raw_page = await r.zrange(key, 0, limit, withscores=True)
    else:
        raw_page = await r.zrangebyscore(key, after.at, "+inf", start=0, num=limit + 1 + TIES,
                                         withscores=True)
    found = [(str(m), int(s)) for m, s in raw_page]  # type: ignore[str-unpack]
    if after is not None:
        found = [(m, s) for m, s in found if s > after.at or m > after.task_id]
    page, more = found[:limit], len(found) > limit
    pending = status == TaskStatus.PENDING.value
    async with r.pipeline(transaction=False) as pipe:
        pipe.zcard(key)
        if pending:
            pipe.zcard(k.retry(e))  # pending too, out of line until their back-off is over
        if page and pending:
            pipe.zcount(key, "-inf", f"({int(page[0][1])}")  # place in line of the first
        for m, _ in page:
            pipe.hmget(k.task(m), _FIELDS)
        raw = await pipe.execute()
    total = raw[0]
    retrying = raw[1] if pending else None
    first_rank = raw[2] if page and pending else None
    rows = raw[-len(page):] if page else []
    tasks = []
    for i, ((task_id, _), values) in enumerate(zip(page, rows, strict=True)):
        item = _item(task_id, dict(zip(_FIELDS, values, strict=True)))
        if first_rank is not None:
            item["wait_num"] = first_rank + i
        tasks.append(item)
    out: dict[str, Any] = {
        "total": total, "tasks": tasks,
        "next_cursor": str(Cursor(int(page[-1][1]), page[-1][0])) if more else None}
    if retrying is not None:
        out["waiting_to_retry"] = retrying  # not in `tasks`: no place in line yet
    return out


def _item(task_id: str, f: dict[str, Any]) -> dict[str, Any]:
    """One task of a list: what tells tasks apart, not their request or result."""
    def num(name: str) -> int | None:
        v = f.get(name)
        return int(v) if v not in (None, "") else None

    return {"task_id": task_id, "task_status": f.get("status"), "task_type": f.get("type"),
            "user_id": num("user_id"), "priority": num("priority"),
            "attempts": num("attempts") or 0, "created_at": rfc3339(f.get("created_at")),
            "started_at": rfc3339(f.get("started_at")), "ended_at": rfc3339(f.get("ended_at")),
            "result_status_code": num("result_status_code")}


async def _finished(queue: TaskQueue, e: str, status: str, limit: int, after: Cursor | None
                    ) -> dict[str, Any]:
    found = await _from_outbox(queue, e, status, after)
    database = "ok"
    try:
        found.update({tid: f for tid, f in (await bounded(_from_sql(queue, e, status, limit,
                                                                    after))).items()
                      if tid not in found})
    except STORE_ERRORS:
        database = "unavailable"
    order = sorted(found, key=lambda tid: (int(found[tid]["ended_at"] or 0), tid), reverse=True)
    page = order[:limit]
    last = page[-1] if page else None
    return {"total": None, "database": database,
            "tasks": [_item(tid, found[tid]) for tid in page],
            "next_cursor": (str(Cursor(int(found[last]["ended_at"] or 0), last))
                            if last and len(order) > limit else None)}


def _before(ended_ms: int, task_id: str, after: Cursor | None) -> bool:
    return after is None or (ended_ms, task_id) < (after.at, after.task_id)


async def _from_outbox(queue: TaskQueue, e: str, status: str, after: Cursor | None
                       ) -> dict[str, dict[str, Any]]:
    """Finished tasks of this status SQL may not have yet (the newest OUTBOX_SCAN)."""
    k, r = queue.keys, queue.redis
    top = after.at if after else "+inf"
    ids = [str(i) for i in await r.zrevrangebyscore(k.outbox(e), top, "-inf", start=0,
                                                     num=OUTBOX_SCAN)]
    if not ids:
        return {}
    async with r.pipeline(transaction=False) as pipe:
        for tid in ids:
            pipe.hmget(k.task(tid), _FIELDS)
        rows = await pipe.execute()
    out = {}
    for tid, values in zip(ids, rows, strict=True):
        f = dict(zip(_FIELDS, values, strict=True))
        if f["status"] == status and _before(int(f["ended_at"] or 0), tid, after):
            out[tid] = f
    return out


async def _from_sql(queue: TaskQueue, e: str, status: str, limit: int, after: Cursor | None
                    ) -> dict[str, dict[str, Any]]:
    if queue.results is None:
        return {}
    q = select(T.c.task_id, T.c.user_id, T.c.type, T.c.status, T.c.attempts, T.c.priority,
               T.c.created_at, T.c.started_at, T.c.ended_at, T.c.result_status_code).where(
        T.c.endpoint == e, T.c.status == status)
    if after is not None:
        at = from_ms(after.at)
        q = q.where(or_(T.c.ended_at < at, and_(T.c.ended_at == at, T.c.task_id < after.task_id)))
    q = q.order_by(T.c.ended_at.desc(), T.c.task_id.desc()).limit(limit + 1)
    async with queue.results.engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    return {row.task_id: {"user_id": row.user_id, "status": row.status, "type": row.type,
                          "priority": row.priority, "attempts": row.attempts,
                          "created_at": to_ms(row.created_at),
                          "started_at": to_ms(row.started_at), "ended_at": to_ms(row.ended_at),
                          "result_status_code": row.result_status_code}
            for row in rows}
