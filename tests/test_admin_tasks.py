"""Admin routes over any user's tasks (app/routes/admin_tasks.py): look up, list by status in
dispatch order and paged, retry, cancel, purge; and an endpoint deleted takes its counters."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from app.core.scripts import Lua
from app.lifecycle import history
from app.queue import operator
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import mock_log


async def _get(gateway: Gateway, path: str, **params: Any) -> Any:
    r = await gateway.http.get(path, headers=gateway.admin, params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def _post(gateway: Gateway, path: str, status: int = 200) -> Any:
    r = await gateway.http.post(path, headers=gateway.admin)
    assert r.status_code == status, r.text
    return r.json()


async def _all_pages(gateway: Gateway, endpoint: str, status: str, limit: int
                     ) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    cursor = None
    for _ in range(50):
        page = await _get(gateway, f"/admin/v1/endpoints/{endpoint}/tasks", status=status,
                          limit=limit, **({"cursor": cursor} if cursor else {}))
        assert len(page["tasks"]) <= limit
        tasks += page["tasks"]
        cursor = page["next_cursor"]
        if cursor is None:
            return tasks
    raise AssertionError("the pages never ended")


async def _wait_ended(gateway: Gateway, task_ids: list[str], timeout: float = 30) -> None:
    for _ in range(int(timeout * 10)):
        shown = [await _get(gateway, f"/admin/v1/tasks/{t}") for t in task_ids]
        if all(s["task_status"] not in ("pending", "processing") for s in shown):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("tasks still unfinished")


@pytest.mark.backends("single", "cluster")  # requeue (retry) and cancel on both
async def test_operator_sees_retries_and_cancels_any_users_task(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{fresh_upstream}/ops"
    await gateway.add_endpoint("ops", url)
    alice, bob = await gateway.new_key(user_id=7), await gateway.new_key(user_id=8)
    failing = (await gateway.submit(alice, url, body="b", headers={"X-Mock-Status": ["400"]}))
    tid = failing["task_id"]
    # Another user sees nothing of it; the operator sees it all.
    assert (await gateway.http.get(f"/api/v1/tasks/{tid}", headers=bob)).status_code == 404
    shown = await _get(gateway, f"/admin/v1/tasks/{tid}")
    assert shown["user_id"] == 7 and shown["endpoint"] == "ops"
    assert shown["task_status"] == "pending" and shown["request"]["body"] == "b"
    assert shown["request"]["headers"] == {"X-Mock-Status": ["400"]}

    # Only a failed or expired task is retried.
    early = await _post(gateway, f"/admin/v1/tasks/{tid}/retry", 409)
    assert early["error"]["task_status"] == "pending"
    # Bob's task, cancelled by the operator: Bob sees it cancelled; a second cancel is 409.
    later = await gateway.submit(bob, url)
    cancelled = await _post(gateway, f"/admin/v1/tasks/{later['task_id']}/cancel")
    assert cancelled == {"task_id": later["task_id"], "task_status": "cancelled"}
    assert (await gateway.status(bob, later["task_id"]))["task_status"] == "cancelled"
    again = await _post(gateway, f"/admin/v1/tasks/{later['task_id']}/cancel", 409)
    assert again["error"]["task_status"] == "cancelled"

    await start_dispatcher()
    (first,) = await gateway.wait_finished(alice, [tid])
    assert first["task_status"] == "failed" and first["result_status_code"] == 400
    shown = await _get(gateway, f"/admin/v1/tasks/{tid}")
    assert shown["task_status"] == "failed" and shown["attempts"] == 1
    assert (await _post(gateway, f"/admin/v1/tasks/{tid}/retry"))["task_status"] == "pending"
    for _ in range(100):
        if len(mock_log(fresh_upstream)) == 2:
            break
        await asyncio.sleep(0.05)
    assert [c["body"] for c in mock_log(fresh_upstream)] == ["b", "b"]  # it ran again

    missing = await gateway.http.get(f"/admin/v1/tasks/{'0' * 32}.ops", headers=gateway.admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "task_not_found"
    for path in (f"/admin/v1/tasks/{tid}", "/admin/v1/endpoints/ops/tasks"):
        assert (await gateway.http.get(path, headers=alice)).status_code == 401


async def test_lists_an_endpoints_tasks_by_status_a_page_at_a_time(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{fresh_upstream}/lst"
    await gateway.add_endpoint("lst", url, max_concurrency=1)
    auth = await gateway.new_key(user_id=3)
    submitted = [await gateway.submit(auth, url, priority=p, body=str(i))
                 for i, p in enumerate([0, 2, 0, 1, 2, 0, 1])]
    ids = [t["task_id"] for t in submitted]
    # Dispatch order: higher priority first, then arrival.
    order = [ids[i] for i in (1, 4, 3, 6, 0, 2, 5)]
    pending = await _all_pages(gateway, "lst", "pending", 3)
    assert [t["task_id"] for t in pending] == order
    assert [t["wait_num"] for t in pending] == list(range(7))
    assert {t["user_id"] for t in pending} == {3} and pending[0]["priority"] == 2
    first = await _get(gateway, "/admin/v1/endpoints/lst/tasks", status="pending", limit=2)
    assert first["total"] == 7 and first["next_cursor"] and first["waiting_to_retry"] == 0

    slow = await gateway.submit(auth, url, priority=9, headers={"X-Mock-Latency-Ms": ["1500"]})
    fail = [await gateway.submit(auth, url, priority=3, headers={"X-Mock-Status": ["404"]})
            for _ in range(3)]
    await start_dispatcher()
    for _ in range(100):
        running = await _get(gateway, "/admin/v1/endpoints/lst/tasks", status="processing")
        if running["tasks"]:
            break
        await asyncio.sleep(0.05)
    assert [t["task_id"] for t in running["tasks"]] == [slow["task_id"]]
    assert running["tasks"][0]["started_at"] is not None
    # Not through their owner's status: a finished task its owner has read is delivered,
    # and neither Redis nor SQL keeps it for long after that.
    await _wait_ended(gateway, [*ids, *(t["task_id"] for t in fail)])

    failed = await _all_pages(gateway, "lst", "failed", 2)
    assert sorted(t["task_id"] for t in failed) == sorted(t["task_id"] for t in fail)
    ends = [t["ended_at"] for t in failed]
    assert ends == sorted(ends, reverse=True)  # newest first
    assert all(t["result_status_code"] == 404 for t in failed)
    for _ in range(200):  # their rows in SQL, out of the outbox: listed from SQL now
        if not await gateway.rt.redis.zcard(gateway.rt.keys.outbox("lst")):
            break
        await asyncio.sleep(0.05)
    failed = await _all_pages(gateway, "lst", "failed", 2)
    assert [t["priority"] for t in failed] == [3, 3, 3]  # kept with the row
    done = await _all_pages(gateway, "lst", "completed", 5)
    assert len(done) == 8 and len({t["task_id"] for t in done}) == 8

    bad = await gateway.http.get("/admin/v1/endpoints/lst/tasks", headers=gateway.admin,
                                 params={"status": "lost"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    bad = await gateway.http.get("/admin/v1/endpoints/lst/tasks", headers=gateway.admin,
                                 params={"cursor": "nonsense"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"

    nope = await gateway.http.get("/admin/v1/endpoints/nope/tasks", headers=gateway.admin)
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "endpoint_not_found"


@pytest.mark.backends("single", "cluster")  # the purge script on both
async def test_purge_cancels_every_pending_task_a_batch_per_script(
    gateway: Gateway, upstream: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(operator, "PURGE_BATCH", 7)  # three full batches and a part
    url = f"{upstream}/purge"
    await gateway.add_endpoint("purge", url)
    await gateway.add_endpoint("other", f"{upstream}/other")
    auth = await gateway.new_key()
    tasks = [await gateway.submit(auth, url) for _ in range(24)]
    kept = await gateway.submit(auth, f"{upstream}/other")
    runs: list[int] = []
    purge = gateway.rt.queue.scripts.purge

    async def counted(*args: Any, **kw: Any) -> Any:
        res = await purge(*args, **kw)
        runs.append(int(res[0]))
        return res

    monkeypatch.setattr(gateway.rt.queue, "scripts",
                        dataclasses.replace(gateway.rt.queue.scripts, purge=cast(Lua, counted)))
    assert await _post(gateway, "/admin/v1/endpoints/purge/purge") == {
        "endpoint": "purge", "cancelled": 24}
    assert runs == [7, 7, 7, 3]
    statuses = {(await gateway.status(auth, t["task_id"]))["task_status"] for t in tasks}
    assert statuses == {"cancelled"}
    queues = {q["id"]: q for q in (await _get(gateway, "/admin/v1/queues"))["endpoints"]}
    assert queues["purge"]["pending"] == 0 and queues["purge"]["cancelled"] == 24
    assert queues["other"]["pending"] == 1  # one endpoint's tasks only
    assert (await gateway.status(auth, kept["task_id"]))["task_status"] == "pending"
    # Submits go on being accepted, and a purge of an empty queue is 0.
    await gateway.submit(auth, url)
    assert (await _post(gateway, "/admin/v1/endpoints/purge/purge"))["cancelled"] == 1
    assert (await _post(gateway, "/admin/v1/endpoints/purge/purge"))["cancelled"] == 0
    r = await gateway.http.post("/admin/v1/endpoints/nope/purge", headers=gateway.admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "endpoint_not_found"


async def test_a_deleted_endpoint_takes_its_counters_along(gateway: Gateway, upstream: str
                                                            ) -> None:
    url = f"{upstream}/gone"
    await gateway.add_endpoint("gone", url)
    auth = await gateway.new_key()
    await gateway.submit(auth, url)
    await _post(gateway, "/admin/v1/endpoints/gone/purge")
    before = (await _get(gateway, "/admin/v1/queues"))["endpoints"][0]
    assert before["submitted"] == 1 and before["cancelled"] == 1
    rt = gateway.rt
    await history.HistorySampler(rt.redis, rt.keys, rt.registry).sample(1_000)
    sampled = await _get(gateway, "/admin/v1/history", endpoints="gone")
    assert sampled["endpoints"]["gone"] == [[1_000, 0, 0, 0, 0]]
    r = await gateway.http.delete("/admin/v1/endpoints/gone", headers=gateway.admin)
    assert r.status_code == 204, r.text
    await gateway.add_endpoint("gone", url)
    after = (await _get(gateway, "/admin/v1/queues"))["endpoints"][0]
    assert after["submitted"] == 0 and after["cancelled"] == 0
    # Nor does its chart come back from the old one's samples.
    assert (await _get(gateway, "/admin/v1/history", endpoints="gone"))["endpoints"] == {
        "gone": []}


@pytest.mark.parametrize("status", ["pending", "processing", "completed", "expired"])
@pytest.mark.parametrize("cursor", ["-2904183446313741781:L\x02", "99999999999999999999:x",
                                    "5:", "abc:def", "-:x", "\u00b2:x"])
async def test_a_cursor_this_route_never_gave_is_a_clear_422(
    gateway: Gateway, upstream: str, status: str, cursor: str
) -> None:
    """Found by schemathesis: a cursor with a control character or an id no task has answered
    500 from the finished lists; any cursor is an answer or a 422, never a 500."""
    await gateway.add_endpoint("cur", f"{upstream}/cur")
    r = await gateway.http.get("/admin/v1/endpoints/cur/tasks", headers=gateway.admin,
                               params={"status": status, "cursor": cursor})
    assert r.status_code in (200, 422), r.text
    if r.status_code == 422:  # refused by the route's own check or by the query's pattern
        assert r.json()["error"]["code"] in ("bad_cursor", "invalid_request")


async def test_an_expired_task_is_retried_and_runs(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    """A task that expired in line (its max_wait_s passed while dispatch was paused) goes back
    in line when the operator retries it, and runs."""
    url = f"{fresh_upstream}/late"
    await gateway.add_endpoint("late", url)
    auth = await gateway.new_key()
    tid = (await gateway.submit(auth, url, max_wait_s=1))["task_id"]  # nothing dispatches yet
    r = await gateway.http.patch("/admin/v1/endpoints/late", headers=gateway.admin,
                                 json={"paused": True})
    assert r.status_code == 200, r.text
    await start_dispatcher()
    await _wait_ended(gateway, [tid], timeout=20)
    assert (await _get(gateway, f"/admin/v1/tasks/{tid}"))["task_status"] == "expired"
    retried = await _post(gateway, f"/admin/v1/tasks/{tid}/retry")
    assert retried["task_status"] == "pending"
    r = await gateway.http.patch("/admin/v1/endpoints/late", headers=gateway.admin,
                                 json={"paused": False})
    assert r.status_code == 200, r.text
    done, = await gateway.wait_finished(auth, [tid])
    assert done["task_status"] == "completed"
    assert [c["idempotency_key"] for c in mock_log(fresh_upstream)] == [tid]
