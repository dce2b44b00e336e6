"""Cancelling a running offline call (cancel-9.lua, app/queue/cancels.py, the dispatcher): the
upstream sees the connection close, the slot serves the next task at once, the task ends
`cancelled`; an answer that came first wins; the owner, the operator, purge and the Python
client all do it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from queue_gateway_client import AsyncClient

from app.main import create_app
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import mock_log

HOLD = {"X-Mock-Latency-Ms": ["30000"]}
StartDispatcher = Callable[[], Awaitable[Runtime]]


async def _arrived(upstream: str, body: str, n: int = 1, timeout: float = 20) -> list[Any]:
    """The first `n` calls the upstream got with `body`, once they are there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        calls = [c for c in mock_log(upstream) if c["body"] == body]
        if len(calls) >= n:
            return calls
        await asyncio.sleep(0.02)
    raise AssertionError(f"{body}: fewer than {n} calls arrived")


async def _closed(upstream: str, body: str, timeout: float = 10) -> float:
    """When the upstream saw the held call with `body` closed (ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (call, *_) = await _arrived(upstream, body)
        if call["closed"] is not None:
            return float(call["closed"])
        await asyncio.sleep(0.02)
    raise AssertionError(f"{body}: the held call was never closed")


@pytest.mark.backends("single", "cluster")
async def test_cancel_aborts_the_call_and_the_next_task_takes_its_slot_within_a_second(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    base = f"{fresh_upstream}/held"
    await gateway.add_endpoint("held", base, max_concurrency=1)
    auth = await gateway.new_key(user_id=5)
    held = await gateway.submit(auth, base, body="a", headers=HOLD)
    nxt = await gateway.submit(auth, base, body="b")
    rt = await start_dispatcher()
    assert rt.dispatcher is not None
    await asyncio.wait_for(rt.dispatcher.cancels_heard.wait(), 10)
    await _arrived(fresh_upstream, "a")
    assert (await gateway.status(auth, held["task_id"]))["task_status"] == "processing"

    asked = time.time() * 1000
    r = await gateway.http.post(f"/api/v1/tasks/{held['task_id']}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["task_status"] == "cancelled", r.text
    closed = await _closed(fresh_upstream, "a")
    (second,) = await _arrived(fresh_upstream, "b")
    print(f"close seen {closed - asked:.0f} ms, next call {second['t'] - asked:.0f} ms "
          "after the cancel")
    assert closed - asked < 1000 and second["t"] - asked < 1000
    (ended,) = await gateway.wait_finished(auth, [nxt["task_id"]])
    assert ended["task_status"] == "completed"
    # The refused ack of the aborted call changed nothing: one writer won.
    shown = (await gateway.http.get(f"/admin/v1/tasks/{held['task_id']}",
                                    headers=gateway.admin)).json()
    assert shown["task_status"] == "cancelled" and shown["result_status_code"] is None
    again = await gateway.http.post(f"/api/v1/tasks/{held['task_id']}/cancel", headers=auth)
    assert again.status_code == 409 and again.json()["error"]["task_status"] == "cancelled"
    k = gateway.rt.keys
    assert await gateway.rt.redis.zcard(k.active("held")) == 0
    stats = await gateway.rt.redis.hmget(k.stats("held"), ["cancelled", "completed"])
    assert [int(x or 0) for x in stats] == [1, 1]


async def test_the_lease_renewal_aborts_a_call_whose_cancel_message_was_not_heard(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    base = f"{fresh_upstream}/deaf"
    await gateway.add_endpoint("deaf", base, max_concurrency=1)
    auth = await gateway.new_key(user_id=5)
    held = await gateway.submit(auth, base, body="a", headers=HOLD)
    rt = await start_dispatcher()
    assert rt.dispatcher is not None
    # The dispatcher stops listening: only its heartbeat (a third of the 3 s lease) is left.
    (listener,) = [t for t in rt.dispatcher._heartbeat if t.get_name() == "cancels"]
    listener.cancel()
    await _arrived(fresh_upstream, "a")
    asked = time.time() * 1000
    r = await gateway.http.post(f"/admin/v1/tasks/{held['task_id']}/cancel",
                                headers=gateway.admin)
    assert r.status_code == 200, r.text
    closed = await _closed(fresh_upstream, "a")
    assert closed - asked < 3000  # one renewal period (1 s) and margin
    assert not rt.dispatcher.inflight


@pytest.mark.backends("single", "cluster")
async def test_a_cancel_racing_a_finishing_call_leaves_one_ending(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    """Calls of 20 ms to 3.9 s (100 ms apart), all cancelled at once (longest first) a moment
    after the first arrives: the short ones answer first, the long ones are cut, and some end
    right as their cancel comes (on a busy machine the cancels may take a second or two).
    Each task is `completed` (its cancel answered 409 naming that) or `cancelled` (its cancel
    answered 200 and its late ack was refused), never both, and the counters add up."""
    base = f"{fresh_upstream}/race"
    await gateway.add_endpoint("race", base, max_concurrency=40)
    auth = await gateway.new_key(user_id=5)
    n = 40
    tasks = [await gateway.submit(auth, base, body="r",
                                  headers={"X-Mock-Latency-Ms": [str(20 + 100 * i)]})
             for i in range(n)]
    await start_dispatcher()
    await _arrived(fresh_upstream, "r")
    await asyncio.sleep(0.2)

    async def cancel(i: int, tid: str) -> tuple[str, int, Any]:
        r = await gateway.http.post(f"/api/v1/tasks/{tid}/cancel", headers=auth)
        return tid, r.status_code, r.json()

    # Longest first: the cancels may go through one after another (tens of ms each on a busy
    # machine); in call order each would come after its call's answer.
    answers = (await asyncio.gather(*(cancel(i, t["task_id"])
                                      for i, t in reversed(list(enumerate(tasks))))))[::-1]
    ended = await gateway.wait_finished(auth, [t["task_id"] for t in tasks])
    for (tid, code, body), final in zip(answers, ended, strict=True):
        if code == 200:
            assert final["task_status"] == "cancelled" and final["task_result"] is None, tid
        else:
            assert code == 409 and body["error"]["task_status"] == "completed", body
            assert final["task_status"] == "completed", tid
    await asyncio.sleep(0.5)  # late acks of aborted calls would land by now
    k = gateway.rt.keys
    stats = await gateway.rt.redis.hmget(k.stats("race"), ["cancelled", "completed"])
    counts = [int(x or 0) for x in stats]
    print(f"race: {counts[0]} cancelled, {counts[1]} completed")
    assert sum(counts) == n and counts[0] == sum(1 for a in answers if a[1] == 200)
    assert counts[0] and counts[1]  # both endings met


async def test_purge_and_the_python_client_cancel_running_calls(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    base = f"{fresh_upstream}/both"
    await gateway.add_endpoint("both", base, max_concurrency=2)
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 6, "max_priority": 5})
    key = str(r.json()["key"])
    app = create_app(gateway.rt, manage=False)
    async with AsyncClient("http://gateway", key, transport=httpx.ASGITransport(app)) as qgw:
        by_client = await qgw.submit(base, body="c", headers=HOLD)
        running = [await qgw.submit(base, body="p", headers=HOLD)]
        queued = await qgw.submit(base, body="q")
        await start_dispatcher()
        await _arrived(fresh_upstream, "c")
        await _arrived(fresh_upstream, "p")
        assert (await by_client.status()).task_status == "processing"
        assert await by_client.cancel() == "cancelled"
        await _closed(fresh_upstream, "c")
        # The slot freed goes to the queued task; purge then cancels the rest, running too.
        await _arrived(fresh_upstream, "q")
        purged = await gateway.http.post("/admin/v1/endpoints/both/purge",
                                         headers=gateway.admin)
        assert purged.json()["cancelled"] == 1, purged.text
        await _closed(fresh_upstream, "p")
        assert (await running[0].status()).task_status == "cancelled"
        assert (await queued.wait(10)).task_status == "completed"
