"""A task's endings only move forward. An operator's retry runs a failed task again, and its
next ending must read as newer than the last even when the Redis that ends it has a clock
behind the one that ended it first (a failover to a replica whose clock is late): SQL keeps a
task's newest ending by `ended_at`, and the outbox writer lets a task go by the `ended_at` it
wrote (lua/includes/now.lua ending_ms)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import update

from app.lifecycle.records import from_ms, to_ms
from app.lifecycle.results import ResultStore, T
from app.queue import operator
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.test_dead_letters import _admin, _ms

HOUR_MS = 3_600_000


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The outbox writer runs often; finished tasks keep the usual hour in Redis."""
    return settings.model_copy(update={"outbox_interval_ms": 100})


async def _row_ended(results: ResultStore, task_id: str, user_id: int, ended_ms: str,
                     timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (row := await results.get(task_id, user_id)) is None or to_ms(row.ended_at) != ended_ms:
        assert time.monotonic() < deadline, ("SQL never got the ending", row, ended_ms)
        await asyncio.sleep(0.1)


@pytest.mark.backends("single", "cluster")
@pytest.mark.parametrize("held_by", ["redis", "sql"])
async def test_a_retried_tasks_next_ending_is_newer_whatever_the_clock_says(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch, held_by: str,
) -> None:
    """The task's first ending is made to read an hour ahead of the Redis clock, in its hash and
    its row, as a master whose clock was ahead would have left them; the retry's delete of the
    old row is abandoned (its bound ran out). Retried from Redis, or from its row once Redis
    let it go, the task fails again: that ending reads later than the first, and SQL takes it.
    Ended at the clock's time, the upsert would keep the first ending for good, and status
    would answer from it once Redis let the task go."""
    user = 7
    url = f"{fresh_upstream}/skew"
    await gateway.add_endpoint("skew-api", url, max_retries=0)
    auth = await gateway.new_key(user_id=user)
    tid = (await gateway.submit(auth, url, body="skewed",
                                headers={"X-Mock-Status": ["500"]}))["task_id"]
    await start_dispatcher()
    (first,) = await gateway.wait_finished(auth, [tid])
    assert first["task_status"] == "failed"
    results = gateway.rt.queue.results
    assert results is not None
    first_ms = _ms(first["ended_at"])
    assert first_ms is not None
    await _row_ended(results, tid, user, first_ms)

    ahead = int(first_ms) + HOUR_MS
    task = gateway.rt.keys.task(tid)
    if held_by == "redis":
        await gateway.rt.redis.hset(task, "ended_at", ahead)
    else:
        await gateway.rt.redis.delete(task)  # its done TTL ran out
    async with results.engine.begin() as conn:
        await conn.execute(update(T).where(T.c.task_id == tid).values(ended_at=from_ms(ahead)))
    abandoned: list[datetime | None] = []

    async def abandon(queue: Any, task_id: str, ended_at: datetime | None) -> None:
        abandoned.append(ended_at)
    monkeypatch.setattr(operator, "_forget_row", abandon)
    retried = await _admin(gateway, "POST", f"/admin/v1/tasks/{tid}/retry")
    assert retried["task_status"] == "pending"
    assert [to_ms(t) for t in abandoned] == [str(ahead)]  # the old ending, as the row has it

    (again,) = await gateway.wait_finished(auth, [tid])
    assert again["task_status"] == "failed"
    again_ms = _ms(again["ended_at"])
    assert again_ms is not None and int(again_ms) > ahead
    await _row_ended(results, tid, user, again_ms)
