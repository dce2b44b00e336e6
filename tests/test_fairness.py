"""Fair turns inside a priority band (endpoint `fairness: "per_user"`, lua/includes/fairness.lua):
one user's backlog delays another user's task by at most one turn per user ahead."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.lifecycle.expiry import ExpirySweep
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import TLS
from tests.test_metrics import scrape, value
from tests.test_storage import open_gateway

pytestmark = pytest.mark.backends("single", "cluster")
BACKLOG, SMALL = 200, 5


async def _calls(base: str, total: int) -> list[str]:
    """The task ids the mock upstream received, in order, once it has received `total`."""
    async with httpx.AsyncClient(base_url=base, verify=TLS) as mock:
        for _ in range(600):
            if (await mock.get("/_mock/stats")).json()["received"] >= total:
                break
            await asyncio.sleep(0.1)
        log: list[dict[str, Any]] = (await mock.get("/_mock/log")).json()
    assert len(log) == total
    return [str(e["idempotency_key"]) for e in log]


async def _backlog_and_two_small_users(
    gateway: Gateway, url: str
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """User 1 submits BACKLOG tasks, then users 2 and 3 SMALL each: (1's ids, theirs, answers)."""
    a, b, c = [await gateway.new_key(user_id=u) for u in (1, 2, 3)]
    big = [(await gateway.submit(a, url))["task_id"] for _ in range(BACKLOG)]
    answers = [await gateway.submit(auth, url) for auth in (b, c) for _ in range(SMALL)]
    return big, [r["task_id"] for r in answers], answers


@pytest.mark.parametrize("fairness", ["per_user", "fifo"])
async def test_small_users_are_not_stuck_behind_a_backlog(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]], fairness: str,
) -> None:
    """One slot, same priority: per_user interleaves users 2 and 3 with user 1's 200 tasks
    (all theirs run before 1's 30th, and wait_num says so at submit); fifo runs them last."""
    url = f"{fresh_upstream}/fair"
    await gateway.add_endpoint("fair", url, max_concurrency=1, fairness=fairness)
    big, small, answers = await _backlog_and_two_small_users(gateway, url)
    dispatcher_process()
    order = await _calls(fresh_upstream, BACKLOG + 2 * SMALL)
    last_small = max(order.index(t) for t in small)
    if fairness == "per_user":
        assert last_small < order.index(big[29])
        # Turn i of user 2 comes after turns 0..i-1 of users 1 and 2 and user 1's turn i;
        # user 3 also after user 2's turn i: the place in line is exact at submit.
        waits = [r["wait_num"] for r in answers]
        assert waits == [2 * i + 1 for i in range(SMALL)] + [3 * i + 2 for i in range(SMALL)]
    else:
        assert min(order.index(t) for t in small) > order.index(big[-1])
        assert [r["wait_num"] for r in answers] == list(range(BACKLOG, BACKLOG + 2 * SMALL))


async def test_priority_stays_strict_between_bands(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """A priority-2 task of the user with the backlog, submitted last, still goes first."""
    url = f"{fresh_upstream}/fair-prio"
    await gateway.add_endpoint("fair-prio", url, max_concurrency=1, fairness="per_user")
    big, small, _ = await _backlog_and_two_small_users(gateway, url)
    urgent = await gateway.submit(await gateway.new_key(user_id=1), url, priority=2)
    assert urgent["wait_num"] == 0
    dispatcher_process()
    order = await _calls(fresh_upstream, BACKLOG + 2 * SMALL + 1)
    assert order[0] == urgent["task_id"]
    assert max(order.index(t) for t in small) < order.index(big[29])


async def test_a_newcomer_mid_backlog_lands_in_the_current_round(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """With the backlog already draining, a new user's task goes right after the task in
    progress and the one at the head, not after the turns user 1 has already taken."""
    url = f"{fresh_upstream}/fair-mid"
    await gateway.add_endpoint("fair-mid", url, max_concurrency=1, fairness="per_user")
    a, b = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)
    slow = {"headers": {"X-Mock-Latency-Ms": ["20"]}}
    big = [(await gateway.submit(a, url, **slow))["task_id"] for _ in range(BACKLOG)]
    dispatcher_process()
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        for _ in range(600):  # until user 1's backlog is well under way
            if (await mock.get("/_mock/stats")).json()["received"] >= 40:
                break
            await asyncio.sleep(0.05)
        late = await gateway.submit(b, url)
        started = (await mock.get("/_mock/stats")).json()["received"]
    assert late["wait_num"] <= 1
    order = await _calls(fresh_upstream, BACKLOG + 1)
    assert order.index(late["task_id"]) <= started + 1
    assert order.index(big[-1]) == BACKLOG  # user 1's own tasks keep their order


@pytest.mark.parametrize("fairness", ["per_user", "fifo"])
async def test_a_deadline_counts_only_the_turns_ahead(gateway: Gateway, fairness: str) -> None:
    """max_wait_s is checked against the place the task would take: on a per_user endpoint a
    new user's task waits one turn behind a 50-task backlog, not 50 tasks (1 s each here)."""
    url = "http://127.0.0.1:9/deadline"
    await gateway.add_endpoint("fair-deadline", url, max_concurrency=1, avg_exec_ms=1000,
                               fairness=fairness)
    a, b = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)
    for _ in range(50):
        await gateway.submit(a, url)
    r = await gateway.http.post("/api/v1/tasks", headers=b,
                                json={"target_url": url, "max_wait_s": 10})
    if fairness == "per_user":
        assert (r.status_code, r.json()["wait_num"]) == (202, 1), r.text
    else:
        assert (r.status_code, r.json()["error"]["code"]) == (409, "deadline_unreachable")
    r = await gateway.http.post("/api/v1/tasks", headers=a,
                                json={"target_url": url, "max_wait_s": 10})
    assert r.status_code == 409  # user 1's own next task is still 50 turns away


async def test_the_sweep_expires_tasks_a_newcomer_sits_ahead_of(settings: Settings) -> None:
    """Turns are not arrival order: user 2's task, newer and not due, sits ahead of user 1's
    older ones, which the sweep must still expire on time (their owner sees `expired`)."""
    settings = settings.model_copy(update={"pending_ttl_s": 1})
    async with open_gateway(settings) as gw:
        url = "http://127.0.0.1:9/fair-exp"
        await gw.add_endpoint("fair-exp", url, fairness="per_user")
        a, b = await gw.new_key(user_id=1), await gw.new_key(user_id=2)
        old = [(await gw.submit(a, url))["task_id"] for _ in range(3)]
        await asyncio.sleep(1.05)
        new = (await gw.submit(b, url))["task_id"]
        rt = gw.rt
        sweep = ExpirySweep(rt.redis, rt.queue.scripts, rt.keys, rt.registry, rt.queue.ttls)
        assert await sweep.sweep() == 3
        assert [(await gw.status(a, t))["task_status"] for t in old] == ["expired"] * 3
        assert (await gw.status(b, new))["task_status"] == "pending"


async def test_a_started_task_leaves_the_deadline_set(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Every per_user task is listed for the sweep while it waits; once started it has no
    pending deadline, and the set must not keep it for the rest of the pending TTL."""
    url = f"{fresh_upstream}/fair-dl"
    await gateway.add_endpoint("fair-dl", url, fairness="per_user")
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(20)]
    deadlines = gateway.rt.keys.queue("fair-dl").replace(":q", ":deadlines")
    assert await gateway.rt.redis.zcard(deadlines) == 20
    dispatcher_process()
    await gateway.wait_finished(auth, ids)
    assert await gateway.rt.redis.zcard(deadlines) == 0


async def test_cancelled_turns_do_not_push_a_users_next_task_back(gateway: Gateway) -> None:
    """User 1 cancels 49 of its 50 tasks: its next one takes the turn after the band's last,
    not turn 50, so user 2's later tasks do not keep passing it."""
    url = "http://127.0.0.1:9/fair-cancel"
    await gateway.add_endpoint("fair-cancel", url, fairness="per_user")
    a, b = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)
    ids = [(await gateway.submit(a, url))["task_id"] for _ in range(50)]
    for tid in ids[1:]:
        r = await gateway.http.post(f"/api/v1/tasks/{tid}/cancel", headers=a)
        assert r.status_code == 200, r.text
    for _ in range(5):
        await gateway.submit(b, url)  # turns 0-4
    mine = await gateway.submit(a, url)  # turn 5: after 1's task 0 and 2's five
    assert mine["wait_num"] == 6
    for _ in range(3):
        await gateway.submit(b, url)  # turns 5-7, behind it
    assert (await gateway.status(a, mine["task_id"]))["wait_num"] == 6


async def test_an_unknown_fairness_is_refused(gateway: Gateway) -> None:
    r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin, json={
        "id": "fair-bad", "target_url": "http://127.0.0.1:9/x", "fairness": "round_robin"})
    assert r.status_code == 422 and "fairness" in r.json()["error"]["message"], r.text
    r = await gateway.http.get("/admin/v1/endpoints/fair-bad", headers=gateway.admin)
    assert r.status_code == 404


@pytest.mark.backends("single", "cluster")
async def test_a_task_at_its_bands_very_start_is_seen_by_the_oldest_lookup(
    gateway: Gateway, fresh_upstream: str
) -> None:
    """A fair turn 0 of arrival 8192 (any multiple of 2^13) scores the band's start itself:
    priority 0's is 0. The oldest-pending lookup took the band to start above it, found no
    head, and its error left /metrics without any endpoint's queue gauges while that task
    led its band (lua/oldest-1.lua)."""
    url = f"{fresh_upstream}/start"
    await gateway.add_endpoint("band-start", url, fairness="per_user", paused=True)
    auth = await gateway.new_key()
    await gateway.rt.redis.set(gateway.rt.keys.seq("band-start"), 8191)
    tid = (await gateway.submit(auth, url))["task_id"]
    assert await gateway.rt.redis.zscore(gateway.rt.keys.queue("band-start"), tid) == 0
    age = value(await scrape(gateway), "qgw_oldest_pending_age_seconds", "band-start")
    assert 0 <= age < 60
