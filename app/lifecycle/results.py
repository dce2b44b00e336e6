"""Finished tasks in SQL: the outbox writer and the store that status falls back to.

Why an outbox: a task finishes inside a Lua script, when SQL may be slow or down. The script
puts the task's id in its endpoint's outbox and takes its TTL away, atomically with the
transition (lua/includes/lifecycle.lua), and this writer moves the tasks to SQL in batches
bounded by rows and bytes, with idempotent upserts; a task leaves the outbox, and gets its done
TTL, only after its row committed (app/lifecycle/outbox.py). SQL down: tasks wait in Redis,
however long, status keeps answering from there, and the API carries on. Several writers at
once only repeat upserts.

A finished task its owner has read is delivered: status-6.lua takes it out of the outbox and
schedules its row for deletion once the read TTL has run out (the `delivered` ZSet); the writer
deletes those rows too, in batches.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import (
    ColumnElement,
    LargeBinary,
    Table,
    case,
    cast,
    delete,
    func,
    or_,
    select,
)
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from app import tracing
from app.core.keys import Keys
from app.core.loop import STORE_ERRORS
from app.core.registry import EndpointRegistry
from app.db import SQL_JOB_TIMEOUT_S, TaskResultRow, bounded
from app.lifecycle.orphans import delete_objects_of
from app.lifecycle.outbox import ROW_OVERHEAD, Outbox, Waiting, by_bytes, by_weight
from app.lifecycle.records import DEAD_LETTERS, request_of, row_from
from app.queue.answers import BASE64, EXTERNAL, ResultMeta
from app.queue.objects import ObjectStore

log = logging.getLogger(__name__)

T: Table = TaskResultRow.__table__  # type: ignore[assignment]  # declared as a FromClause
#: Updated on a repeat, `ended_at` last: MySQL assigns in order, so every column's condition
#: reads the row's old ending.
_UPDATED = [c.name for c in T.columns if c.name not in ("task_id", "ended_at")] + ["ended_at"]
#: Rows per INSERT statement are also capped by size, below MySQL's default
#: max_allowed_packet (16 MB) whatever the results weigh.
STATEMENT_BYTES = 4 << 20


def _not_older(ended_at: Any) -> ColumnElement[bool]:
    """The incoming row ended no earlier than the stored one (or that one has no ending)."""
    return or_(T.c.ended_at.is_(None), ended_at >= T.c.ended_at)


class ResultStore:
    """task_results: upserts from the outbox, deletes of delivered rows, lookups by owner."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @functools.cached_property
    def _upsert(self) -> Any:
        """One statement for every batch, executed with the list of rows (executemany: the
        driver sends them together; pymysql as multi-row VALUES). Built once: its compilation
        is cached, where a statement built with .values(rows) was compiled afresh for every
        batch (a tenth of a dispatcher's CPU at 1,000 tasks a second), and building even this
        one per batch was a twentieth of a `qgw serve`'s CPU.

        A row never goes back to an older ending: a task retried and ended again can be written
        by two writers (one read its first ending, then committed late), and the newer ending
        must stay whichever commits last."""
        if self.engine.dialect.name == "sqlite":
            lite = sqlite_insert(T)
            return lite.on_conflict_do_update(
                index_elements=[T.c.task_id], set_={c: lite.excluded[c] for c in _UPDATED},
                where=_not_older(lite.excluded.ended_at))
        my = mysql_insert(T)
        newer = _not_older(my.inserted.ended_at)
        return my.on_duplicate_key_update(
            [(c, case((newer, my.inserted[c]), else_=T.c[c])) for c in _UPDATED])

    async def upsert(self, rows: list[dict[str, Any]]) -> None:
        """Write rows in one transaction; a repeat of the same row changes nothing."""
        if not rows:
            return
        stmt = self._upsert
        async with asyncio.timeout(SQL_JOB_TIMEOUT_S), self.engine.begin() as conn:
            for chunk in _chunks(rows):
                await conn.execute(stmt, chunk)

    async def delete(self, task_ids: list[str], objects: ObjectStore | None = None,
                     refs: list[str] | None = None, ended_at: datetime | None = None) -> int:
        """Delete rows, and their objects in the result store with them (and the objects
        `refs`, of tasks whose row may never have been written); with `ended_at`, only rows of
        the ending at that time."""
        if not task_ids:
            return 0
        where: list[ColumnElement[bool]] = [T.c.task_id.in_(task_ids)]
        if ended_at is not None:
            where.append(T.c.ended_at == ended_at)
        async with asyncio.timeout(SQL_JOB_TIMEOUT_S), self.engine.begin() as conn:
            await delete_objects_of(conn, objects, task_ids, refs or [], where=where)
            res = await conn.execute(delete(T).where(*where))
        return int(getattr(res, "rowcount", 0) or 0)

    async def get(self, task_id: str, user_id: int, result_limit: int = 0) -> Any | None:
        """The row of this user's task, or None (unknown, or somebody else's). With
        `result_limit`, a longer `result` (bytes) is not read: None, and `result_omitted` its
        length, so a large read takes its slot before the megabytes leave the database."""
        return await bounded(self._get(task_id, user_id, result_limit))

    async def _get(self, task_id: str, user_id: int, result_limit: int) -> Any | None:
        where = (T.c.task_id == task_id, T.c.user_id == user_id)
        async with self.engine.connect() as conn:
            if not result_limit:
                return (await conn.execute(select(T).where(*where))).first()
            head = (await conn.execute(select(*HEAD).where(*where))).first()
            if head is None:
                return None
            size = kept_bytes(head.result_meta)
            if size is None:  # no meta (a result the gateway wrote): the database measures
                size = (await conn.execute(
                    select(func.length(cast(T.c.result, LargeBinary))).where(*where))).scalar()
            large = size is not None and size > result_limit
            result = None if large else (
                await conn.execute(select(T.c.result).where(*where))).scalar()
            return SimpleNamespace(**head._mapping, result=result,
                                   result_omitted=size if large else None)


#: A row's columns but its result and a dead letter's request: what a status read needs first.
HEAD = tuple(c for c in T.c if c.name not in ("result", "request"))


def kept_bytes(raw_meta: str | None) -> int | None:
    """How long the row's `result` text is, from its meta (None without one): an answer's
    bytes kept as UTF-8 text, or their base64, or nothing for one in the result store."""
    meta = ResultMeta.loads(raw_meta)
    if meta is None:
        return None
    if meta.encoding == EXTERNAL:
        return 0
    return 4 * ((meta.size + 2) // 3) if meta.encoding == BASE64 else meta.size


#: MySQL errors that are about the row, not the connection: Data too long (1406), Out of range
#: (1264), Incorrect string value (1366), packet too large (1153, 1301).
_ROW_ERRORS = frozenset({1153, 1264, 1301, 1366, 1406})


#: The most a row's texts may take escaped in one MySQL statement: the default
#: max_allowed_packet (16 MiB), less room for the rest of the row and the statement.
PACKET_BYTES = (16 << 20) - (256 << 10)
_ESCAPED = ("\\", "'", '"', "\n", "\r", "\0", "\x1a")  # sent as two bytes each


def escaped_bytes(text: str | None) -> int:
    """How many bytes `text` takes in a MySQL statement (its escapable characters doubled)."""
    if not text:
        return 0
    return len(text.encode()) + sum(text.count(c) for c in _ESCAPED)


def refused(exc: DBAPIError) -> bool:
    """The database refused the data, rather than being unreachable."""
    if isinstance(exc, (DataError, IntegrityError)):
        return True
    args: tuple[Any, ...] = getattr(exc.orig, "args", ())
    return bool(args) and args[0] in _ROW_ERRORS


def _chunks(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    return by_weight(rows, lambda row: ROW_OVERHEAD + len(row["result"] or "") * 4,  # utf8mb4
                     STATEMENT_BYTES)


@dataclass
class OutboxWriter:
    redis: Redis
    keys: Keys
    registry: EndpointRegistry
    store: ResultStore
    batch: int = 500
    #: Results per SQL transaction, in bytes (a larger single result goes alone): a backlog of
    #: large results moves in steps that each commit well within SQL_JOB_TIMEOUT_S.
    batch_bytes: int = 16 << 20
    done_ms: int = 3_600_000  # the done TTL a task gets once its row is written
    objects: ObjectStore | None = None  # delivered rows' result objects go with them
    outbox: Outbox = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.redis, self.keys)

    async def flush(self) -> int:
        """Move every outbox record to SQL and delete delivered rows that are due; returns the
        number of rows written. Raises when SQL or Redis fails: the caller retries. One
        endpoint's trouble does not keep the others' records out of SQL."""
        written, failure = 0, None
        for endpoint in self.registry.all():
            try:
                written += await self.write(endpoint.id)
                await self._delete_delivered(endpoint.id)
            except STORE_ERRORS as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return written

    async def write(self, endpoint_id: str) -> int:
        """Move one endpoint's outbox to SQL; the number of rows written. Ids and sizes come
        first (a small reply), then the tasks in transactions of at most `batch` rows and
        `batch_bytes` of results, each fetched in bounded replies (app/lifecycle/outbox.py)."""
        written = 0
        while True:
            waiting = await self.outbox.waiting(endpoint_id, self.batch)
            for sizes in by_bytes(waiting.sizes, self.batch_bytes):
                written += await self._write_batch(replace(waiting, sizes=sizes))
            if not waiting.sizes or (not waiting.legacy and len(waiting.sizes) < self.batch):
                return written

    async def _write_batch(self, waiting: Waiting) -> int:
        started_ns = time.time_ns() if tracing.ENABLED else 0
        records = await self.outbox.fetch(waiting)
        rows = []
        for task_id, rec in records.items():
            extra = {"task_id": task_id, "endpoint": waiting.endpoint}
            if rec is None:  # not a TTL (it has none while here): somebody deleted it
                log.error("a finished task left Redis before reaching SQL", extra=extra)
                continue
            try:
                row = row_from(task_id, rec)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("dropping a malformed outbox record: %s", exc,
                          extra={**extra, "record": str(rec)[:500]})
                continue
            if row["status"] in ("completed", "failed", "cancelled", "expired"):
                rows.append(row)  # else it runs again: it comes back here when it ends
        await self._keep_requests(waiting.endpoint, rows)
        count = len(rows)  # those without their result too, as refused ones below
        if self.store.engine.dialect.name != "sqlite":
            rows = await self._without_oversized(rows, records)
        for i in range(0, len(rows), self.batch):
            chunk = rows[i:i + self.batch]
            try:
                await self.store.upsert(chunk)
            except DBAPIError as exc:
                if not refused(exc):
                    raise
                # A row the database refuses (out of range, too large) must not hold back
                # the rest of the batch, nor every later one: one at a time, the refused ones
                # without their result.
                for row in chunk:
                    if not await self._write_alone(row):
                        # Its whole record, result included, stays in Redis for an operator:
                        # SQL has the row without the result, or no row at all.
                        await self.outbox.refused(row["endpoint"], row["task_id"],
                                                  records[row["task_id"]] or {})
        if tracing.ENABLED and rows:  # before `saved` (which starts the hashes' done TTL)
            contexts = await self.outbox.headers([row["task_id"] for row in rows])
            tracing.outbox_spans(waiting.endpoint, self.store.engine.dialect.name, contexts,
                                 started_ns)
        # Only now, after the commit: a crash before this line only repeats the upserts.
        await self.outbox.saved(waiting, records, self.done_ms)
        return count

    async def _without_oversized(self, rows: list[dict[str, Any]],
                                 records: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows MySQL can take in one statement; the others written without their result
        now (kept in Redis, outbox:refused). A statement over max_allowed_packet is not
        refused but cut off with the connection (2013, an outage to the writer), which
        held every later task of the endpoint out of SQL: text of quotes or newlines is sent
        escaped, twice its size."""
        fitting = []
        for row in rows:
            texts = row["result"] or "", row.get("request") or ""
            # Escaped, a character takes 4 bytes at most: most rows need no count at all.
            if 4 * sum(map(len, texts)) <= PACKET_BYTES:
                fitting.append(row)
                continue
            size = sum(map(escaped_bytes, texts))
            if size <= PACKET_BYTES:
                fitting.append(row)
            elif not await self._write_alone(row, f"{size} bytes escaped, over what one SQL "
                                             f"statement takes ({PACKET_BYTES})"):
                await self.outbox.refused(row["endpoint"], row["task_id"],
                                          records[row["task_id"]] or {})
        return fitting

    async def _keep_requests(self, endpoint_id: str, rows: list[dict[str, Any]]) -> None:
        """Dead letters keep their request in their row, so an operator can run them again
        once Redis let them go (docs/guides/dead-letters.md)."""
        dead = [row for row in rows if row["status"] in DEAD_LETTERS]
        if not dead:
            return
        endpoint = self.registry.get(endpoint_id)
        forwarded = endpoint.forwarded if endpoint is not None else None
        fields = await self.outbox.requests(endpoint_id, [row["task_id"] for row in dead])
        for row in dead:
            row["request"] = request_of(fields[row["task_id"]], forwarded)

    async def _write_alone(self, row: dict[str, Any], too_large: str | None = None) -> bool:
        """Write one row, without its result if it must (at once when it is `too_large` to
        send: why); False unless it went in whole."""
        extra = {"task_id": row["task_id"], "endpoint": row["endpoint"]}
        why = too_large
        if why is None:
            first = await self._refusal(row)
            if first is None:
                return True
            why = str(first.orig)
        log.error("the database refused a finished task (%s); its row is kept without the "
                  "result, the result in Redis (outbox:refused)", why, extra=extra)
        reason = f"[result not stored: {why}]"[:1000]
        # Its meta goes too (the reason is text, not the base64 it described), but for an
        # answer in the result store: the meta is its object's only reference.
        meta = ResultMeta.loads(row.get("result_meta"))
        second = await self._refusal({
            **row, "result_status_code": None, "result": reason,
            "result_meta": row.get("result_meta") if meta and meta.encoding == EXTERNAL
            else None})
        if second is None:
            return False
        log.error("the database refused a finished task even without its result (%s); its "
                  "record is kept in Redis (outbox:refused)", second.orig, extra=extra)
        return False

    async def _refusal(self, row: dict[str, Any]) -> DBAPIError | None:
        """None once the row is written; the database's refusal if it refused the data."""
        try:
            await self.store.upsert([row])
        except DBAPIError as exc:
            if not refused(exc):
                raise
            return exc
        return None

    async def _delete_delivered(self, endpoint_id: str, until: float | None = None) -> None:
        """Delete the rows (and objects) of delivered tasks due by `until` (default: now, by
        Redis's clock). A member is a task id, or the key of its object in the result store
        (`<task id>/<random>`, status-6.lua), deleted here with the row."""
        key = self.keys.delivered(endpoint_id)
        if until is None:
            now_s, now_us = await self.redis.time()
            until = now_s * 1000 + now_us // 1000
        while True:
            members: list[str] = await self.redis.zrangebyscore(  # type: ignore[assignment]
                key, "-inf", until, start=0, num=self.batch)
            if not members:
                return
            ids = [m.split("/", 1)[0] for m in members]
            await self.store.delete(ids, self.objects, [m for m in members if "/" in m])
            await self.redis.zrem(key, *members)
            if len(members) < self.batch:
                return

    async def forget_delivered(self, endpoint_id: str) -> None:
        """A deleted endpoint's delivered tasks, due or not, go now: no writer serves an
        endpoint that is gone, and its results read already would otherwise stay until the
        janitor's retention."""
        await self._delete_delivered(endpoint_id, float("inf"))
        await self.redis.delete(self.keys.delivered(endpoint_id))
