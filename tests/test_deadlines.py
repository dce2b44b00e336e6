"""Deadlines (max_wait_s) and an estimate that counts the limiter and the upstream's pause."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest

from app.runtime import Runtime
from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")
StartDispatcher = Callable[[], Awaitable[Runtime]]


async def _admitted_once(gateway: Gateway, auth: dict[str, str], url: str, n: int,
                         start_dispatcher: StartDispatcher) -> None:
    """n tasks run by a dispatcher, which then stops: the limiter's state is theirs."""
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(n)]
    rt = await start_dispatcher()
    done = await gateway.wait_finished(auth, ids)
    assert {d["task_status"] for d in done} == {"completed"}
    await rt.stop(grace_s=0)


async def test_the_head_of_a_rate_held_line_waits_for_the_limiter(
    gateway: Gateway, upstream: str, start_dispatcher: StartDispatcher
) -> None:
    """1 a minute: the task after one just admitted is next in line, but a minute away."""
    url = f"{upstream}/slow-rate"
    await gateway.add_endpoint("slow-rate", url, rate=1, interval_ms=60_000)
    auth = await gateway.new_key()
    first = await gateway.submit(auth, url)
    rt = await start_dispatcher()
    (done,) = await gateway.wait_finished(auth, [first["task_id"]])
    assert done["task_status"] == "completed"
    await rt.stop(grace_s=0)
    second = await gateway.submit(auth, url)
    assert second["wait_num"] == 0 and 55 <= second["wait_time"] <= 60, second
    status = await gateway.status(auth, second["task_id"])
    assert 55 <= status["wait_time"] <= 60  # status says the same


async def test_a_further_limit_alone_holds_the_head_of_the_line(
    gateway: Gateway, upstream: str, start_dispatcher: StartDispatcher
) -> None:
    """No main rate, `limits: 1 a minute`: the task after one just admitted is a minute away,
    at submit (the claim that emptied the line noted when the limits admit next) and at
    status (the claim the submit woke was refused until then)."""
    url = f"{upstream}/limits-only"
    await gateway.add_endpoint("limits-only", url, limits=[{"rate": 1, "interval_ms": 60_000}])
    auth = await gateway.new_key()
    await _admitted_once(gateway, auth, url, 1, start_dispatcher)
    second = await gateway.submit(auth, url)
    assert second["wait_num"] == 0 and 55 <= second["wait_time"] <= 60, second
    await start_dispatcher()
    await asyncio.sleep(1)
    status = await gateway.status(auth, second["task_id"])
    assert status["task_status"] == "pending" and 54 <= status["wait_time"] <= 60, status


async def test_a_spent_second_limit_holds_the_head_of_the_line(
    gateway: Gateway, upstream: str, start_dispatcher: StartDispatcher
) -> None:
    """3/s and 4 per 30 s, the 30 s spent: the next task waits out the 30 s, not a third of
    a second."""
    url = f"{upstream}/two-limits"
    await gateway.add_endpoint("two-limits", url, rate=3, interval_ms=1000,
                               limits=[{"rate": 4, "interval_ms": 30_000}])
    auth = await gateway.new_key()
    await _admitted_once(gateway, auth, url, 4, start_dispatcher)
    nxt = await gateway.submit(auth, url)
    assert nxt["wait_num"] == 0 and 25 <= nxt["wait_time"] <= 30, nxt


async def test_a_per_cost_limit_counts_the_cost_of_the_tasks_ahead(
    gateway: Gateway, upstream: str
) -> None:
    """1,000 units a minute, paced (limits.lua), tasks of cost 500: the 20th waits for 19
    half-minutes, and a deadline short of that is refused."""
    url = "http://127.0.0.1:9/cost-eta"
    await gateway.add_endpoint("cost-eta", url, limits=[
        {"rate": 1000, "interval_ms": 60_000, "per": "cost"}])
    auth = await gateway.new_key()
    for _ in range(19):
        await gateway.submit(auth, url, cost=500)
    last = await gateway.submit(auth, url, cost=500)
    assert last["wait_num"] == 19 and 540 <= last["wait_time"] <= 600, last
    status = await gateway.status(auth, last["task_id"])
    assert 540 <= status["wait_time"] <= 600, status
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "cost": 500, "max_wait_s": 300})
    assert r.status_code == 409 and r.json()["error"]["wait_time"] >= 540, r.text


async def _held_row(gateway: Gateway, endpoint: str) -> dict[str, Any]:
    """The endpoint's row of /admin/v1/queues once a limit holds its line (or after 5 s)."""
    for _ in range(50):
        r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
        (row,) = [q for q in r.json()["endpoints"] if q["id"] == endpoint]
        if row["binding_limit"]:
            break
        await asyncio.sleep(0.1)
    return dict(row)


async def test_operators_see_which_further_limit_binds(
    gateway: Gateway, upstream: str, start_dispatcher: StartDispatcher
) -> None:
    """A limits-only endpoint held by its 1-a-minute limit names that limit."""
    url = f"{upstream}/binding-limits"
    await gateway.add_endpoint("binding-limits", url, limits=[
        {"rate": 1, "interval_ms": 60_000}, {"rate": 100, "interval_ms": 1000}])
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(2)]
    await start_dispatcher()
    await gateway.wait_finished(auth, ids[:1])
    row = await _held_row(gateway, "binding-limits")
    assert row["binding_limit"] == "limits: 1/60000ms per request", row
    admits = datetime.fromisoformat(row["admits_next_at"]).timestamp()
    assert 50 < admits - time.time() <= 60


async def test_operators_see_the_rate_limit_binding_and_when_it_admits_next(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/binding"
    await gateway.add_endpoint("binding", url, rate=1, interval_ms=60_000)
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(2)]
    await start_dispatcher()
    await gateway.wait_finished(auth, ids[:1])
    row = await _held_row(gateway, "binding")
    assert row["binding_limit"] == "rate" and row["pending"] == 1
    admits = datetime.fromisoformat(row["admits_next_at"]).timestamp()
    assert 50 < admits - time.time() <= 60


async def test_an_upstream_pause_counts_in_the_estimate(gateway: Gateway, upstream: str) -> None:
    url = f"{upstream}/paused-eta"
    await gateway.add_endpoint("paused-eta", url)
    auth = await gateway.new_key()
    seconds, micros = await gateway.rt.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    await gateway.rt.redis.hset(gateway.rt.keys.stats("paused-eta"), "upause", now_ms + 30_000)
    task = await gateway.submit(auth, url)
    assert 29 <= task["wait_time"] <= 31, task


async def test_max_wait_s_refuses_a_deadline_the_estimate_already_misses(
    gateway: Gateway, upstream: str
) -> None:
    url = f"{upstream}/deadline"
    await gateway.add_endpoint("deadline", url, max_concurrency=1, avg_exec_ms=10_000)
    auth = await gateway.new_key()
    for _ in range(3):
        await gateway.submit(auth, url)
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 5})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    # 3 ahead, one 10 s slot, which is free: 2.5 slot times.
    assert error["code"] == "deadline_unreachable" and error["wait_time"] == 25
    assert isinstance(error["wait_time"], int)
    # Nothing was queued for it; a reachable deadline (or a VIP ahead of the line) is taken.
    assert (await gateway.rt.redis.zcard(gateway.rt.keys.queue("deadline"))) == 3
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 60})
    assert r.status_code == 202, r.text
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 5, "priority": 5})
    assert r.status_code == 202, r.text


async def test_a_resent_submit_is_answered_with_its_task_whatever_the_estimate(
    gateway: Gateway, upstream: str
) -> None:
    """Queued within its deadline, then 5 more behind it: resending it (same Idempotency-Key,
    same body) answers with that task, not 409 deadline_unreachable for a task not refused."""
    url = "http://127.0.0.1:9/resend"
    await gateway.add_endpoint("resend", url, max_concurrency=1, avg_exec_ms=10_000)
    auth = await gateway.new_key()
    keyed = {**auth, "Idempotency-Key": "resend-1"}
    body = {"target_url": url, "max_wait_s": 5}
    first = await gateway.http.post("/api/v1/tasks", headers=keyed, json=body)
    assert first.status_code == 202, first.text
    for _ in range(5):
        await gateway.submit(auth, url)
    again = await gateway.http.post("/api/v1/tasks", headers=keyed, json=body)
    assert again.status_code == 202, again.text
    assert again.json()["task_id"] == first.json()["task_id"]
    assert again.json()["wait_num"] == 0
    assert (await gateway.rt.redis.zcard(gateway.rt.keys.queue("resend"))) == 6
    # A new key is still held to the deadline.
    other = await gateway.http.post("/api/v1/tasks", headers={**auth, "Idempotency-Key": "r-2"},
                                    json=body)
    assert other.status_code == 409, other.text


async def test_a_task_not_started_by_its_deadline_expires_even_behind_older_ones(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """The sweep finds it though the task ahead of it (same priority) is not due for hours."""
    url = f"{upstream}/deadline-sweep"
    await gateway.add_endpoint("deadline-sweep", url)
    auth = await gateway.new_key()
    await gateway.submit(auth, url)
    hurried = await gateway.submit(auth, url, max_wait_s=1)  # nothing dispatches yet
    r = await gateway.http.patch("/admin/v1/endpoints/deadline-sweep", headers=gateway.admin,
                                 json={"paused": True})
    assert r.status_code == 200, r.text
    started = time.monotonic()
    await start_dispatcher()  # runs the sweep; the endpoint is paused, so nothing starts
    for _ in range(100):
        status = await gateway.status(auth, hurried["task_id"])
        if status["task_status"] != "pending":
            break
        await asyncio.sleep(0.1)
    assert status["task_status"] == "expired" and status["started_at"] is None
    assert time.monotonic() - started < 5


async def test_a_paused_endpoints_wait_is_unknown(gateway: Gateway, upstream: str) -> None:
    """While its operator has paused the endpoint, nobody can say when a task starts:
    `wait_time` is null in the submit's answer and the status, and a deadline (max_wait_s)
    is refused with 409 endpoint_paused rather than promised; resumed, the estimate is a
    whole number again."""
    url = f"{upstream}/held"
    await gateway.add_endpoint("held", url, paused=True, max_concurrency=1, avg_exec_ms=2000)
    auth = await gateway.new_key()
    first = await gateway.submit(auth, url)
    second = await gateway.submit(auth, url)
    assert (first["wait_num"], first["wait_time"]) == (0, None)
    assert (second["wait_num"], second["wait_time"]) == (1, None)
    status = await gateway.status(auth, second["task_id"])
    assert (status["wait_num"], status["wait_time"]) == (1, None)
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 3600})
    assert r.status_code == 409 and r.json()["error"]["code"] == "endpoint_paused", r.text
    assert r.json()["error"]["wait_num"] == 2

    r = await gateway.http.patch("/admin/v1/endpoints/held", headers=gateway.admin,
                                 json={"paused": False})  # no dispatcher: the line stays
    assert r.status_code == 200, r.text
    status = await gateway.status(auth, second["task_id"])
    assert status["wait_num"] == 1 and status["wait_time"] == 1  # half a slot of 2 s
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 3600})
    assert r.status_code == 202 and r.json()["wait_time"] == 3, r.text  # 1.5 slots
