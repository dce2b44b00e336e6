"""The janitor: deletes task_results rows older than QGW_DB_RETENTION_S.

In batches of at most 1000, each its own short transaction: select the oldest keys through the
`created_at` index (ORDER BY + LIMIT stops the range scan there; each batch starts past the
last one's, by `created_at` then `task_id`), then delete them by primary key, which on InnoDB
locks only those rows, never a range a writer inserts into (new rows are the newest). The same
statements run on SQLite. With several replicas, one holds a Redis lock and does the work.

A row goes only once Redis has let its task go: one whose task Redis still holds (its done or
read TTL not over, its webhook still due, or running again after an operator's retry) waits for
a later pass, so no hash is left naming a row, or a result object, deleted from under it (a
retention shorter than the done TTL, or than a long wait in line). While Redis does not answer,
nothing can be checked and nothing goes: the pass ends, and the next one tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy import Table, and_, delete, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.core.keys import Keys, endpoint_of
from app.core.scripts import Lua, source
from app.db import SQL_JOB_TIMEOUT_S, TaskResultRow, utcnow
from app.lifecycle.orphans import delete_objects_of
from app.queue.objects import ObjectStore

log = logging.getLogger(__name__)
T: Table = TaskResultRow.__table__  # type: ignore[assignment]  # declared as a FromClause
LOCK_TTL_S = 30


@dataclass
class PurgeStats:
    rows: int = 0
    statements: int = 0
    batches: list[int] = field(default_factory=list)
    longest_delete_s: float = 0.0
    elapsed_s: float = 0.0


@dataclass
class Janitor:
    engine: AsyncEngine
    retention_s: int
    batch: int = 1000
    redis: Redis | None = None
    keys: Keys | None = None
    objects: ObjectStore | None = None  # the rows' result objects go with them
    _statuses: Lua | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.redis is not None:
            self._statuses = Lua(self.redis, source("rows"))  # each hash's status, one reply

    async def run_once(self) -> PurgeStats | None:
        """Purge under the replicas' lock; None when another replica holds it."""
        if self.redis is None or self.keys is None:
            return await self.purge()
        lock = self.redis.lock(self.keys.lock("janitor"), timeout=LOCK_TTL_S, blocking=False)
        try:
            if not await lock.acquire():
                return None
        except RedisError as exc:  # nor could the rows' tasks be checked: the next pass
            log.info("janitor lock unavailable (%s); the next pass will try again", exc)
            return None
        try:
            return await self.purge(lock.reacquire)
        finally:
            with contextlib.suppress(RedisError):
                await lock.release()

    async def purge(
        self, keep_lock: Callable[[], Awaitable[object]] | None = None,
        cutoff: datetime | None = None,
    ) -> PurgeStats:
        """Delete every row created before `cutoff` (default: now - retention)."""
        cutoff = cutoff or utcnow() - timedelta(seconds=self.retention_s)
        stats, started = PurgeStats(), time.monotonic()
        batch = min(self.batch, 1000)
        past: tuple[datetime, str] | None = None  # the last row the previous batch read
        while True:
            async with asyncio.timeout(SQL_JOB_TIMEOUT_S), self.engine.begin() as conn:
                query = select(T.c.task_id, T.c.created_at).where(T.c.created_at < cutoff)
                if past is not None:  # rows still held are not read again in this pass
                    query = query.where(or_(T.c.created_at > past[0], and_(
                        T.c.created_at == past[0], T.c.task_id > past[1])))
                found = (await conn.execute(
                    query.order_by(T.c.created_at, T.c.task_id).limit(batch))).all()
                stats.statements += 1
                if not found:
                    break
                past = (found[-1].created_at, found[-1].task_id)
                held = await self._held([r.task_id for r in found])
                if held is None:
                    break  # Redis did not answer: the next pass
                ids = [r.task_id for r in found if r.task_id not in held]
                t0 = time.monotonic()
                if ids:
                    await delete_objects_of(conn, self.objects, ids)
                    await conn.execute(delete(T).where(T.c.task_id.in_(ids)))
                    stats.statements += 1
            # Its row locks last until the commit that just ended the block.
            stats.longest_delete_s = max(stats.longest_delete_s, time.monotonic() - t0)
            stats.rows += len(ids)
            stats.batches.append(len(ids))
            if keep_lock is not None:
                with contextlib.suppress(RedisError):
                    await keep_lock()
            if len(found) < batch:
                break
        stats.elapsed_s = time.monotonic() - started
        if stats.rows:
            log.info("janitor deleted %d rows in %d batches (%.1f s)", stats.rows,
                     len(stats.batches), stats.elapsed_s)
        return stats

    async def _held(self, task_ids: list[str]) -> set[str] | None:
        """Those of these tasks Redis still holds (one script call per endpoint: its keys share
        a slot on a Cluster); None when Redis could not say."""
        if self._statuses is None or self.keys is None:
            return set()
        by_endpoint: dict[str, list[str]] = defaultdict(list)
        for tid in task_ids:
            by_endpoint[endpoint_of(tid)].append(tid)
        held: set[str] = set()
        try:
            for ids in by_endpoint.values():
                replies = await self._statuses(keys=[self.keys.task(t) for t in ids],
                                               args=["status"])
                held.update(t for t, (status,) in zip(ids, replies, strict=True) if status)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            log.warning("janitor waits: Redis did not answer (%s)", exc)
            return None
        except RedisError as exc:
            log.error("janitor stopped: Redis refused to say which rows it holds (%s)", exc)
            return None
        return held
