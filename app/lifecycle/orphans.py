"""The result store's sweep: objects no task refers to any more are deleted.

An object goes when its task goes, on each path that deletes one: the outbox writer deletes a
delivered task's row and its object (by the key status-6.lua scheduled, even when no row was
ever written; app/lifecycle/results.py), the janitor a row past the retention and its object
(`delete_objects_of`), an endpoint deleted takes its delivered tasks' rows and objects with it
(app/runtime.py), and a dispatcher deletes an answer whose ack was refused, its task cancelled
or its lease lost (app/queue/dispatcher.py). Each is best effort: a store that does not answer
is logged and leaves the object here.

The sweep is the safety net behind them: it deletes any object older than
QGW_RESULT_SWEEP_GRACE_S that no task refers to, in Redis (the hash's `result_meta`) or in SQL
(the row's), and what a process killed with -9 left half-way (a `file://` staging file, an S3
multipart upload: app/queue/uploads.py). The grace keeps it off an answer just stored, whose
ack is on its way. One dispatcher of all sweeps in each QGW_RESULT_SWEEP_INTERVAL_S (a Redis
lock held for the interval), a page of the listing at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import ColumnElement, Table, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.core.keys import Keys
from app.db import TaskResultRow
from app.queue.answers import EXTERNAL, ResultMeta
from app.queue.objects import LIST_BATCH, ObjectStore, StoredObject
from app.queue.uploads import abort_stale_uploads

log = logging.getLogger(__name__)
T: Table = TaskResultRow.__table__  # type: ignore[assignment]  # declared as a FromClause
BATCH = 200  # tasks looked up per round trip
SWEEP_LOCK = "result-sweep"  # Keys.lock: held for an interval by the dispatcher that sweeps


def refs(metas: Iterable[str | None]) -> list[str]:
    """The store keys these `result_meta` values refer to."""
    out = []
    for raw in metas:
        meta = ResultMeta.loads(raw)
        if meta is not None and meta.encoding == EXTERNAL and meta.ref:
            out.append(meta.ref)
    return out


async def delete_objects_of(conn: AsyncConnection, objects: ObjectStore | None,
                            task_ids: list[str], known: Iterable[str] = (),
                            where: Sequence[ColumnElement[bool]] = ()) -> None:
    """Delete the objects of rows about to be deleted (in `conn`'s transaction: those of
    `task_ids`, or the rows `where` selects), and the objects `known` besides. A store that
    does not answer leaves them to the sweep rather than holding the rows back."""
    if objects is None or not task_ids:
        return
    metas = (await conn.scalars(select(T.c.result_meta).where(
        *(where or [T.c.task_id.in_(task_ids)]),
        T.c.result_meta.like('%"enc":"external"%')))).all()
    await objects.drop(sorted({*refs(metas), *known}))


@dataclass
class OrphanSweep:
    objects: ObjectStore
    redis: Redis
    keys: Keys
    engine: AsyncEngine
    grace_s: float
    interval_s: float = 300.0
    list_batch: int = LIST_BATCH  # objects listed, looked up and deleted per round

    async def run_once(self) -> int | None:
        """This interval's sweep, by one dispatcher of all: the first to take the lock (SET NX
        PX, the interval counted by Redis's clock, not the processes') sweeps, and nobody
        releases it, so every other dispatcher's turn in the same interval finds it taken and
        skips (None). A sweep longer than the interval keeps extending it, batch by batch."""
        lock = self.redis.lock(self.keys.lock(SWEEP_LOCK), timeout=self.interval_s,
                               blocking=False)
        if not await lock.acquire():
            return None
        return await self.sweep(keep_lock=lock.reacquire)

    async def sweep(self, grace_s: float | None = None,
                    keep_lock: Callable[[], Awaitable[object]] | None = None) -> int:
        """Delete every object older than the grace no task refers to; how many went. The
        listing is walked a batch at a time, each looked up and deleted before the next."""
        grace = self.grace_s if grace_s is None else grace_s
        deleted = 0
        async for batch in self.objects.batches(grace, self.list_batch):
            deleted += await self._sweep_batch(batch)
            if keep_lock is not None:
                with contextlib.suppress(RedisError):
                    await keep_lock()
        deleted += await asyncio.to_thread(self._stale_staging, grace)
        deleted += await abort_stale_uploads(self.objects, grace)
        if deleted:
            log.info("result store: %d orphaned objects deleted", deleted)
        return deleted

    async def _sweep_batch(self, batch: list[StoredObject]) -> int:
        by_task: dict[str, list[str]] = {}
        for obj in batch:
            by_task.setdefault(obj.key.split("/", 1)[0], []).append(obj.key)
        ids, deleted = list(by_task), 0
        for i in range(0, len(ids), BATCH):
            chunk = ids[i:i + BATCH]
            kept = set(await self._referenced(chunk))
            gone = [k for t in chunk for k in by_task[t] if k not in kept]
            await self.objects.delete(gone)
            deleted += len(gone)
        return deleted

    async def _referenced(self, task_ids: list[str]) -> list[str]:
        """The keys these tasks refer to, in Redis or in SQL (either failing raises: nothing
        is deleted on half an answer)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for tid in task_ids:
                pipe.hget(self.keys.task(tid), "result_meta")
            in_redis: list[Any] = await pipe.execute()
        async with self.engine.connect() as conn:
            in_sql = (await conn.scalars(select(T.c.result_meta).where(
                T.c.task_id.in_(task_ids), T.c.result_meta.is_not(None)))).all()
        return refs([*in_redis, *in_sql])

    def _stale_staging(self, grace_s: float) -> int:
        """`file://`: the staging files (`<key>#<n>`) of uploads a killed process left, and
        the task folders left empty. A directory walk: run in a thread."""
        root: Path | None = getattr(self.objects, "root", None)
        if root is None or not root.exists():
            return 0
        cutoff, n = time.time() - grace_s, 0
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    if "#" in name and os.stat(path).st_mtime < cutoff:
                        os.unlink(path)
                        n += 1
                except OSError:
                    continue
            if folder != str(root):
                # A task's folder left empty (its staging file removed just now, or by a
                # process killed while it deleted); an upload that starts there meanwhile
                # makes it again (obstore creates the parents of a file it cannot create).
                with contextlib.suppress(OSError):  # not empty: rmdir leaves it
                    os.rmdir(folder)
        return n
