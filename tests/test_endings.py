"""A task's endings only move forward. An operator's retry runs a failed task again, and its
next ending must read as newer than the last even when the Redis that ends it has a clock
behind the one that ended it first (a failover to a replica whose clock is late): SQL keeps a
task's newest ending by `ended_at`, and the outbox writer lets a task go by the `ended_at` it
wrote (lua/includes/now.lua ending_ms)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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
USER = 7


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The outbox writer runs often; finished tasks keep the usual hour in Redis."""
    return settings.model_copy(update={"outbox_interval_ms": 100})


async def _row_ended(results: ResultStore, task_id: str, ended_ms: str,
                     timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (row := await results.get(task_id, USER)) is None or to_ms(row.ended_at) != ended_ms:
        assert time.monotonic() < deadline, ("SQL never got the ending", row, ended_ms)
        await asyncio.sleep(0.1)


@dataclass
class Skewed:
    """A failed task whose ending reads an hour ahead of the Redis clock, in its hash and its
    row, as a master whose clock was ahead would have left them."""

    auth: dict[str, str]
    task_id: str
    ahead: int  # its ending (ms)
    results: ResultStore


async def _failed_an_hour_ahead(gateway: Gateway, upstream: str,
                                start_dispatcher: Callable[[], Awaitable[Runtime]],
                                forget_in_redis: bool = False) -> Skewed:
    """`forget_in_redis`: Redis then lets the task go (its done TTL ran out), SQL holds it."""
    url = f"{upstream}/skew"
    await gateway.add_endpoint("skew-api", url, max_retries=0)
    auth = await gateway.new_key(user_id=USER)
    tid = (await gateway.submit(auth, url, body="skewed",
                                headers={"X-Mock-Status": ["500"]}))["task_id"]
    await start_dispatcher()
    (first,) = await gateway.wait_finished(auth, [tid])
    assert first["task_status"] == "failed"
    results = gateway.rt.queue.results
    assert results is not None
    first_ms = _ms(first["ended_at"])
    assert first_ms is not None
    await _row_ended(results, tid, first_ms)

    ahead = int(first_ms) + HOUR_MS
    task = gateway.rt.keys.task(tid)
    if forget_in_redis:
        await gateway.rt.redis.delete(task)
    else:
        await gateway.rt.redis.hset(task, "ended_at", ahead)
    async with results.engine.begin() as conn:
        await conn.execute(update(T).where(T.c.task_id == tid).values(ended_at=from_ms(ahead)))
    return Skewed(auth, tid, ahead, results)


async def _retried_keeping_the_old_row(gateway: Gateway, skewed: Skewed,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's retry whose delete of the old row is abandoned (its bound ran out): the
    first ending's row stays."""
    abandoned: list[datetime | None] = []

    async def abandon(queue: Any, task_id: str, ended_at: datetime | None) -> None:
        abandoned.append(ended_at)
    monkeypatch.setattr(operator, "_forget_row", abandon)
    retried = await _admin(gateway, "POST", f"/admin/v1/tasks/{skewed.task_id}/retry")
    assert retried["task_status"] == "pending"
    assert [to_ms(t) for t in abandoned] == [str(skewed.ahead)]  # the old ending, as its row


@pytest.mark.backends("single", "cluster")
@pytest.mark.parametrize("held_by", ["redis", "sql"])
async def test_a_retried_tasks_next_ending_is_newer_whatever_the_clock_says(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch, held_by: str,
) -> None:
    """Retried from Redis, or from its row once Redis let it go, the task fails again (the
    dispatcher's ack): that ending reads later than the first, and SQL takes it. Ended at the
    clock's time, the upsert would keep the first ending for good, and status would answer
    from it once Redis let the task go."""
    skewed = await _failed_an_hour_ahead(gateway, fresh_upstream, start_dispatcher,
                                         forget_in_redis=held_by == "sql")
    await _retried_keeping_the_old_row(gateway, skewed, monkeypatch)
    (again,) = await gateway.wait_finished(skewed.auth, [skewed.task_id])
    assert again["task_status"] == "failed"
    again_ms = _ms(again["ended_at"])
    assert again_ms is not None and int(again_ms) > skewed.ahead
    await _row_ended(skewed.results, skewed.task_id, again_ms)


@pytest.mark.backends("single", "cluster")
async def test_a_retried_task_cancelled_in_line_also_ends_after_its_last_ending(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same through the step every other ending shares (lua/includes/lifecycle.lua
    to_outbox): the retried task is cancelled by its owner while it waits in line (its
    endpoint disabled, nothing takes it)."""
    skewed = await _failed_an_hour_ahead(gateway, fresh_upstream, start_dispatcher)
    r = await gateway.http.patch("/admin/v1/endpoints/skew-api", headers=gateway.admin,
                                 json={"enabled": False})
    assert r.status_code == 200, r.text
    await _retried_keeping_the_old_row(gateway, skewed, monkeypatch)
    r = await gateway.http.post(f"/api/v1/tasks/{skewed.task_id}/cancel", headers=skewed.auth)
    assert r.status_code == 200, r.text
    ended = await gateway.rt.redis.hget(gateway.rt.keys.task(skewed.task_id), "ended_at")
    assert ended is not None and int(ended) > skewed.ahead
    await _row_ended(skewed.results, skewed.task_id, str(int(ended)))
