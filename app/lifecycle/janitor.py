"""The janitor: deletes task_results rows older than QGW_DB_RETENTION_S.

In batches of at most 1000, each its own short transaction: select the oldest keys through the
`created_at` index (ORDER BY + LIMIT stops the range scan there), then delete them by primary
key, which on InnoDB locks only those rows, never a range a writer inserts into (new rows are the
newest). The same statements run on SQLite. With several replicas, one holds a Redis lock and
does the work; without the lock the others may join in, which is harmless (a key deleted twice
is deleted once).

Retention is the end of a finished task wherever it is kept: each batch's tasks that have ended
leave Redis first (lua/retire-1.lua), so a hash never outlives its row and names a result
object deleted with it (a retention shorter than the done TTL, or than a long wait in line and
the done TTL). While Redis does not answer the pass stops there: rows wait for the next one
rather than go from under hashes that still name them.
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
from redis.exceptions import RedisError
from sqlalchemy import Table, delete, select
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
    _retire: Lua | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.redis is not None:
            self._retire = Lua(self.redis, source("retire"))

    async def run_once(self) -> PurgeStats | None:
        """Purge under the replicas' lock; None when another replica holds it."""
        if self.redis is None or self.keys is None:
            return await self.purge()
        lock = self.redis.lock(self.keys.lock("janitor"), timeout=LOCK_TTL_S, blocking=False)
        try:
            if not await lock.acquire():
                return None
        except RedisError as exc:
            log.info("janitor lock unavailable (%s); purging without it", exc)
            return await self.purge()
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
        while True:
            async with asyncio.timeout(SQL_JOB_TIMEOUT_S), self.engine.begin() as conn:
                ids = (await conn.scalars(
                    select(T.c.task_id).where(T.c.created_at < cutoff)
                    .order_by(T.c.created_at).limit(batch))).all()
                stats.statements += 1
                if not ids:
                    break
                if not await self._retired(list(ids)):
                    break  # Redis did not answer: the next pass
                t0 = time.monotonic()
                await delete_objects_of(conn, self.objects, list(ids))
                await conn.execute(delete(T).where(T.c.task_id.in_(ids)))
                stats.statements += 1
            # Its row locks last until the commit that just ended the block.
            stats.longest_delete_s = max(stats.longest_delete_s, time.monotonic() - t0)
            stats.rows += len(ids)
            stats.batches.append(len(ids))
            if keep_lock is not None:
                with contextlib.suppress(RedisError):
                    await keep_lock()
            if len(ids) < batch:
                break
        stats.elapsed_s = time.monotonic() - started
        if stats.rows:
            log.info("janitor deleted %d rows in %d batches (%.1f s)", stats.rows,
                     len(stats.batches), stats.elapsed_s)
        return stats

    async def _retired(self, task_ids: list[str]) -> bool:
        """These tasks' ended hashes deleted from Redis (one script call per endpoint: its keys
        share a slot on a Cluster); False when Redis did not answer."""
        if self._retire is None or self.keys is None:
            return True
        by_endpoint: dict[str, list[str]] = defaultdict(list)
        for tid in task_ids:
            by_endpoint[endpoint_of(tid)].append(tid)
        k = self.keys
        try:
            for endpoint, ids in by_endpoint.items():
                await self._retire(keys=[k.outbox(endpoint), *(k.task(t) for t in ids)],
                                   args=ids)
        except (RedisError, OSError) as exc:
            log.warning("janitor stopped: Redis did not answer (%s); the rows wait", exc)
            return False
        return True
