"""An operator's retried task back in its line: at its old place, with a deadline of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Tasks wait 3 s at most and stay 1 s after they end; the expiry sweep runs often."""
    return settings.model_copy(update={"pending_ttl_s": 3, "done_ttl_s": 1,
                                       "expiry_interval_ms": 100})


@pytest.mark.backends("single", "cluster")
async def test_a_retried_task_does_not_hold_back_the_expiry_of_tasks_behind_it(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    """Back at its old place, ahead of a task submitted since, the retried task's deadline is
    later than that task's. The sweep walks a band in order and stops at the first task not
    yet due: it stopped at the retried one, and the task behind went unexpired until its hash
    lapsed, ending nowhere (no `expired`, no row: a status 404)."""
    url = f"{fresh_upstream}/line"
    await gateway.add_endpoint("line-api", url, max_retries=0)
    auth = await gateway.new_key()
    first = (await gateway.submit(auth, url, body="first",
                                  headers={"X-Mock-Status": ["500"]}))["task_id"]
    await start_dispatcher()
    (failed,) = await gateway.wait_finished(auth, [first])
    assert failed["task_status"] == "failed"
    r = await gateway.http.patch("/admin/v1/endpoints/line-api", headers=gateway.admin,
                                 json={"paused": True})
    assert r.status_code == 200, r.text
    behind = (await gateway.submit(auth, url, body="behind"))["task_id"]
    await asyncio.sleep(1.5)
    r = await gateway.http.post(f"/admin/v1/tasks/{first}/retry", headers=gateway.admin)
    assert r.status_code == 200 and r.json()["wait_num"] == 0, r.text  # ahead of `behind`

    (ended,) = await gateway.wait_finished(auth, [behind], timeout=10)
    assert ended["task_status"] == "expired"
    assert (await gateway.status(auth, first))["task_status"] == "pending"


@pytest.mark.backends("single", "cluster")
async def test_the_sweep_steps_past_a_bounded_run_of_retried_tasks_to_the_bands_below(
    gateway: Gateway,
) -> None:
    """A bulk retry can put thousands back at the head of a band, each with a deadline the
    deadline set watches: the walk steps past 32 of them, then goes on to the next band, and
    a task due there still expires (stepping past every one, its steps ran out first)."""
    rt, e = gateway.rt, "walk"
    k, band = rt.keys, -(2**43)  # priority 1's start (submit-11.lua)
    secs, micros = await rt.redis.time()
    now = secs * 1000 + micros // 1000
    for i in range(40):
        tid = f"{i + 1:032x}.{e}"
        await rt.redis.hset(k.task(tid), mapping={"status": "pending", "pexp": now + 60_000,
                                                  "dl": 2, "type": "offline"})
        await rt.redis.zadd(k.queue(e), {tid: band + i + 1})
        await rt.redis.zadd(k.deadlines(e), {tid: now + 60_000})
    # Priority 0, past its deadline, at the band's very start (score 0: a fair turn 0), where
    # the walk's jump lands.
    due = f"{'f' * 32}.{e}"
    await rt.redis.hset(k.task(due), mapping={"status": "pending", "pexp": now - 1,
                                              "type": "offline"})
    await rt.redis.zadd(k.queue(e), {due: 0})
    res = await rt.queue.scripts.expire(
        keys=list(k.of(e, "queue", "stats", "outbox", "deadlines", "hooks")),
        args=[k.task_prefix(e), 0, 10, 40])
    assert [int(x) for x in res] == [1, 0]
    assert await rt.redis.hget(k.task(due), "status") == "expired"
    assert await rt.redis.zcard(k.queue(e)) == 40  # the retried ones wait on
