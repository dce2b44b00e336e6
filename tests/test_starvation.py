"""Bounded starvation (endpoint `max_starvation_s`, lua/includes/starvation.lua): a task
waiting longer than the bound is served before higher priorities."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest

from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")
FLOOD = 5000


def _ms(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000


async def test_a_flood_of_high_priorities_delays_a_low_one_by_at_most_the_bound(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """A priority-0 task, then 5,000 of priority 9 (200/s: 25 s of work): it starts once it
    has waited the bound, ahead of the thousands of priority 9 still waiting (without the
    bound it would start last, after all of them)."""
    url = f"{fresh_upstream}/starve"
    await gateway.add_endpoint("starve", url, rate=200, paused=True, max_starvation_s=3600)
    auth = await gateway.new_key()
    low = await gateway.submit(auth, url, priority=0)
    began = time.monotonic()
    # Started now, while the endpoint is paused: its start-up (seconds on a busy machine)
    # must not count against the bound measured below.
    dispatcher_process()

    async def flood(n: int) -> None:
        for _ in range(n):
            await gateway.submit(auth, url, priority=9)

    await asyncio.gather(*(flood(FLOOD // 25) for _ in range(25)))
    # The bound: a few seconds past the time the flood took to submit, while it is all
    # still waiting (the endpoint was paused until now).
    bound = math.ceil(time.monotonic() - began) + 3
    r = await gateway.http.patch("/admin/v1/endpoints/starve", headers=gateway.admin,
                                 json={"paused": False, "max_starvation_s": bound})
    assert r.status_code == 200, r.text
    for _ in range(300):
        status = await gateway.status(auth, low["task_id"])
        if status["task_status"] != "pending":
            break
        await asyncio.sleep(0.1)
    waited = _ms(status["started_at"]) - _ms(status["created_at"])
    assert bound * 1000 - 100 <= waited <= bound * 1000 + 2500, (bound, waited)
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        log = (await mock.get("/_mock/log")).json()
    served_before = [e["idempotency_key"] for e in log].index(low["task_id"])
    assert 100 <= served_before <= FLOOD - 1000  # priority held until then, not after


async def test_the_bound_is_checked(gateway: Gateway) -> None:
    for bad in (0, -1, 86_401, "5"):
        r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin, json={
            "id": "starve-bad", "target_url": "http://127.0.0.1:9/x", "max_starvation_s": bad})
        assert r.status_code == 422 and "max_starvation_s" in r.json()["error"]["message"]


BOUND_S, BEHIND = 4, 200  # the bound; priority-9 tasks queued behind it, 20/s: 10 s of work
# How the low task is handed back, and what its first call is told to answer (its second
# call, Status-Times 1, is a 200): each requeue script must put it back in the arrival index
# at its first arrival, or the flood queued ahead of it by priority holds it to the end.
HAND_BACKS = {
    "refused": {"X-Mock-Status": ["503"], "X-Mock-Reply-Headers": [json.dumps({
        "retry-after": "1"})]},  # given back to its place (retry-8.lua)
    "backoff": {"X-Mock-Status": ["500"]},  # retry-8.lua, then the claim when it is due
    "operator": {"X-Mock-Status": ["400"]},  # failed, then an operator's retry (requeue-7.lua)
    "revived": {"X-Mock-Status": ["400"]},  # the same once only SQL has it (revive-5.lua)
    "released": {},  # its dispatcher stops (release-8.lua)
    "reaped": {},  # its dispatcher is killed; the other's reaper (reap-7.lua)
}


@pytest.mark.backends("single")  # and on a Cluster below, every way with a script of its own
@pytest.mark.parametrize("how", list(HAND_BACKS))
async def test_a_task_handed_back_keeps_its_first_arrival(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]], how: str,
) -> None:
    """A priority-0 task is claimed; while its first call runs (3 s), 200 tasks of priority 9
    queue ahead of it; then it is handed back (each way a task goes back in line). It still
    starts once it has waited the bound from its submit, ahead of the rest of the flood, not
    after all of it."""
    url = f"{fresh_upstream}/back-{how}"
    await gateway.add_endpoint(f"back-{how}", url, max_concurrency=1, rate=20,
                               max_retries=1, retry_backoff_ms=200, max_starvation_s=BOUND_S)
    auth = await gateway.new_key()
    first = dispatcher_process(QGW_SHUTDOWN_GRACE_S="0")
    await gateway.wait_finished(auth, [(await gateway.submit(auth, url))["task_id"]], 60)
    if how in ("released", "reaped"):  # the one to take over, up before the clock starts
        dispatcher_process()
        await _dispatchers(gateway, 2)
    low = await gateway.submit(auth, url, priority=0, headers={
        **HAND_BACKS[how], "X-Mock-Status-Times": ["1"], "X-Mock-Latency-Ms": ["3000"]})
    await _until(gateway, auth, low["task_id"], "processing")

    async def behind(n: int) -> list[str]:
        return [(await gateway.submit(auth, url, priority=9))["task_id"] for _ in range(n)]

    flood = {t for ts in await asyncio.gather(*(behind(BEHIND // 10) for _ in range(10)))
             for t in ts}
    # Still in its first call: the flood is ahead of it when it is handed back.
    assert (await gateway.status(auth, low["task_id"]))["task_status"] == "processing"
    if how == "released":
        first.terminate()
    elif how == "reaped":
        first.kill()
    elif how in ("operator", "revived"):
        await _until(gateway, auth, low["task_id"], "failed")
        if how == "revived":  # its row written, Redis lets the task go
            k, e = gateway.rt.keys, f"back-{how}"
            for _ in range(600):
                if await gateway.rt.redis.zscore(k.outbox(e), low["task_id"]) is None:
                    break
                await asyncio.sleep(0.05)
            await gateway.rt.redis.delete(k.task(low["task_id"]))
        r = await gateway.http.post(f"/admin/v1/tasks/{low['task_id']}/retry",
                                    headers=gateway.admin)
        assert r.status_code == 200, r.text
    (done,) = await gateway.wait_finished(auth, [low["task_id"]], 60)
    assert done["task_status"] == "completed", done
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        log = (await mock.get("/_mock/log")).json()
    # Its last call (a call cut short by its dispatcher's end is in the log too).
    served = max(e["t"] for e in log if e["idempotency_key"] == low["task_id"])
    # The flood served before it: each of those calls is over (the cap is 1) and logged. The
    # rest of the flood comes after it; not waited for (10 s of each of these tests).
    before = {e["idempotency_key"] for e in log if e["idempotency_key"] in flood
              and e["t"] < served}
    # Served at its bound (give or take a claim on a busy machine), most of the flood after.
    assert served - _ms(low["created_at"]) <= BOUND_S * 1000 + 3000, how
    assert len(before) <= BEHIND - BEHIND // 2, (how, len(before))


@pytest.mark.backends("cluster")
@pytest.mark.parametrize("how", [h for h in HAND_BACKS if h != "backoff"])
async def test_a_task_handed_back_on_a_cluster_keeps_its_first_arrival(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]], how: str,
) -> None:
    """The same on a Cluster, where each requeue script takes the arrival index as an optional
    last key (a Cluster-only mistake of that shape happened once, in submit-11.lua). Not
    `backoff`: retry-8.lua is `refused`'s script too, and each way is 8 s of the suite."""
    await test_a_task_handed_back_keeps_its_first_arrival(
        gateway, fresh_upstream, dispatcher_process, how)


async def _dispatchers(gateway: Gateway, n: int) -> None:
    for _ in range(600):
        r = await gateway.http.get("/admin/v1/overview", headers=gateway.admin)
        if len(r.json()["dispatchers"]) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {n} dispatchers came up")


async def _until(gateway: Gateway, auth: dict[str, str], task_id: str, status: str) -> None:
    for _ in range(600):
        if (await gateway.status(auth, task_id))["task_status"] == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} never became {status}")
