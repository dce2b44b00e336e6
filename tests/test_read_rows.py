"""A finished task read by its owner leaves SQL too, however its read falls against the outbox
writer (lua/status-6.lua): here the done TTL is shorter than the read TTL, so a read that comes
after the writer saved the row finds the hash's TTL already short, and the row must still go."""

from __future__ import annotations

import asyncio

import pytest

from app.settings import Settings
from tests.conftest import Gateway
from tests.test_storage import Start, eventually, finish, rows

# The race is Redis's and the outbox writer's: one database is enough.
pytestmark = [pytest.mark.backends("single", "cluster"),
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


@pytest.fixture
def settings(settings: Settings, db_url: str) -> Settings:
    return settings.model_copy(update={
        # The done TTL leaves the test a few seconds to read the task once its row is saved,
        # under load too; the read TTL is longer still.
        "database_url": db_url, "read_ttl_s": 4, "done_ttl_s": 3, "outbox_interval_ms": 50,
    })


async def test_a_read_after_the_row_is_saved_still_removes_the_row(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    auth, (tid,) = await finish(gateway, upstream, start_dispatcher, "late-read")
    redis, keys = gateway.rt.redis, gateway.rt.keys

    async def saved() -> bool:  # saved-1.lua ran: out of the outbox, its done TTL set
        return (tid in await rows(gateway.rt.engine)
                and await redis.zscore(keys.outbox("late-read"), tid) is None
                and await redis.pttl(keys.task(tid)) > 0)

    await eventually(saved, timeout=10)
    assert (await gateway.status(auth, tid))["task_status"] == "completed"
    assert await redis.zscore(keys.delivered("late-read"), tid) is not None
    # Before the fix, nothing scheduled it: the row stayed until the retention's purge.
    await eventually(lambda: _no_row(gateway, tid), timeout=15)


async def _no_row(gateway: Gateway, tid: str) -> bool:
    return tid not in await rows(gateway.rt.engine)


async def test_reading_again_does_not_put_the_rows_deletion_off(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    auth, (tid,) = await finish(gateway, upstream, start_dispatcher, "reread")
    redis, keys = gateway.rt.redis, gateway.rt.keys
    await gateway.status(auth, tid)
    first = await redis.zscore(keys.delivered("reread"), tid)
    await asyncio.sleep(0.2)
    await gateway.status(auth, tid)
    assert first is not None and await redis.zscore(keys.delivered("reread"), tid) == first
