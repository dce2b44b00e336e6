"""The offline path end to end: submit, wait in line, run against the mock upstream, finish."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import pytest

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import mock_log
from tests.test_metrics import wait_until

pytestmark = pytest.mark.backends("single", "cluster")


def _log(upstream: str, path: str) -> list[dict[str, object]]:
    return [e for e in mock_log(upstream) if e["path"] == path]


async def test_status_walks_pending_processing_completed(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("walk", f"{upstream}/walk", max_concurrency=1)
    auth = await gateway.new_key()
    task = await gateway.submit(
        auth,
        f"{upstream}/walk",
        body='{"prompt": "cat"}',
        headers={"X-Mock-Latency-Ms": ["600"]},
        query_params={"size": ["512"]},
    )
    assert task["task_status"] == "pending" and task["wait_num"] == 0
    first = await gateway.status(auth, task["task_id"])
    assert first["task_status"] == "pending"
    assert first["created_at"] and first["started_at"] is None and first["ended_at"] is None

    await start_dispatcher()
    seen = ["pending"]
    for _ in range(100):
        s = await gateway.status(auth, task["task_id"])
        if s["task_status"] != seen[-1]:
            seen.append(s["task_status"])
        if s["task_status"] == "completed":
            break
        await asyncio.sleep(0.05)
    assert seen == ["pending", "processing", "completed"]
    assert s["result_status_code"] == 200 and s["attempts"] == 1 and s["wait_time"] == 0
    created, started, ended = (
        datetime.fromisoformat(s[k]) for k in ("created_at", "started_at", "ended_at")
    )
    assert created <= started < ended
    assert json.loads(s["task_result"])["echo"] == '{"prompt": "cat"}'
    (call,) = _log(upstream, "/walk")
    assert call["query"] == {"size": "512"}
    assert call["idempotency_key"] == task["task_id"]


async def test_wait_num_is_exact_and_priority_jumps_the_line(
    gateway: Gateway, upstream: str
) -> None:
    await gateway.add_endpoint("line", f"{upstream}/line", rate=2, interval_ms=1000)
    auth = await gateway.new_key(max_priority=5)
    low = [await gateway.submit(auth, f"{upstream}/line") for _ in range(5)]
    assert [t["wait_num"] for t in low] == [0, 1, 2, 3, 4]
    vip = await gateway.submit(auth, f"{upstream}/line", priority=3)
    assert vip["wait_num"] == 0
    assert [(await gateway.status(auth, t["task_id"]))["wait_num"] for t in low] == [1, 2, 3, 4, 5]
    s = await gateway.status(auth, low[-1]["task_id"])
    assert s["wait_time"] == 3  # five ahead at two a second: 2.5 s, in whole seconds


async def test_cancelled_pending_task_never_reaches_upstream(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("cancel", f"{upstream}/cancel")
    auth = await gateway.new_key()
    keep = await gateway.submit(auth, f"{upstream}/cancel", body="keep")
    drop = await gateway.submit(auth, f"{upstream}/cancel", body="drop")
    r = await gateway.http.post(f"/api/v1/tasks/{drop['task_id']}/cancel", headers=auth)
    assert r.json() == {"task_id": drop["task_id"], "task_status": "cancelled"}
    await start_dispatcher()
    (done,) = await gateway.wait_finished(auth, [keep["task_id"]])
    assert done["task_status"] == "completed"
    assert (await gateway.status(auth, drop["task_id"]))["task_status"] == "cancelled"
    assert [e["body"] for e in _log(upstream, "/cancel")] == ["keep"]
    again = await gateway.http.post(f"/api/v1/tasks/{keep['task_id']}/cancel", headers=auth)
    assert again.status_code == 409
    assert again.json()["error"]["task_status"] == "completed"


async def test_500_tasks_arrive_in_priority_then_arrival_order(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("order", f"{upstream}/order", max_concurrency=1)
    auth = await gateway.new_key(max_priority=9)
    rng = random.Random(7)
    submitted = []
    for i in range(500):
        prio = rng.randint(0, 9)
        await gateway.submit(auth, f"{upstream}/order", priority=prio, body=str(i))
        submitted.append((prio, i))
    expected = [str(i) for _, i in sorted(submitted, key=lambda p: (-p[0], p[1]))]
    await start_dispatcher()
    for _ in range(600):
        arrived = [e["body"] for e in _log(upstream, "/order")]
        if len(arrived) == 500:
            break
        await asyncio.sleep(0.05)
    assert arrived == expected


async def test_failed_4xx_keeps_the_response_and_is_not_retried(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("bad", f"{upstream}/bad", retry_backoff_ms=10)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}/bad", headers={"X-Mock-Status": ["400"]})
    await start_dispatcher()
    (s,) = await gateway.wait_finished(auth, [task["task_id"]])
    assert s["task_status"] == "failed" and s["result_status_code"] == 400
    assert s["attempts"] == 1 and len(_log(upstream, "/bad")) == 1


async def test_5xx_is_retried_up_to_max_retries(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("flaky", f"{upstream}/flaky", retry_backoff_ms=20, max_retries=2)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}/flaky", headers={"X-Mock-Status": ["503"]})
    await start_dispatcher()
    (s,) = await gateway.wait_finished(auth, [task["task_id"]])
    assert s["task_status"] == "failed" and s["result_status_code"] == 503
    assert s["attempts"] == 3 and len(_log(upstream, "/flaky")) == 3


async def test_a_task_backing_off_shows_its_wait_by_the_redis_clock(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The back-off's end (`retry_at`) is stamped by Redis: its `wait_time` is counted on the
    same clock, whatever the API host's says (an hour behind here: it showed an hour more)."""
    await gateway.add_endpoint("later", f"{upstream}/later", retry_backoff_ms=60_000,
                               max_retries=1)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}/later", headers={
        "X-Mock-Status": ["503"], "X-Mock-Status-Times": ["1"]})
    await start_dispatcher()

    async def backing_off() -> bool:
        s = await gateway.status(auth, task["task_id"])
        return bool(s["task_status"] == "pending" and s["attempts"] == 1)

    await wait_until(backing_off)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    s = await gateway.status(auth, task["task_id"])
    monkeypatch.undo()
    assert s["wait_num"] == 0 and 0 < s["wait_time"] <= 60
    r = await gateway.http.post(f"/api/v1/tasks/{task['task_id']}/cancel", headers=auth)
    assert r.status_code == 200, r.text
    # Cancelled, it waits for nothing: its `retry_at` stays in its hash, its wait does not.
    assert (await gateway.status(auth, task["task_id"]))["wait_time"] == 0


async def test_other_users_cannot_see_or_cancel_a_task(gateway: Gateway, upstream: str) -> None:
    await gateway.add_endpoint("mine", f"{upstream}/mine")
    alice, bob = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)
    task = await gateway.submit(alice, f"{upstream}/mine")
    for r in (
        await gateway.http.get(f"/api/v1/tasks/{task['task_id']}", headers=bob),
        await gateway.http.post(f"/api/v1/tasks/{task['task_id']}/cancel", headers=bob),
    ):
        assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found"
    assert (await gateway.status(alice, task["task_id"]))["task_status"] == "pending"


async def test_online_task_gets_a_permit_and_complete_frees_its_slot(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("live", f"{upstream}/live", max_concurrency=1, permit_ttl_s=30)
    auth = await gateway.new_key()
    first = await gateway.submit(auth, f"{upstream}/live", task_type="online")
    second = await gateway.submit(auth, f"{upstream}/live", task_type="online")
    early = await gateway.http.post(f"/api/v1/tasks/{first['task_id']}/complete", headers=auth)
    assert early.status_code == 409 and early.json()["error"]["task_status"] == "pending"
    await start_dispatcher()
    for _ in range(100):
        s = await gateway.status(auth, first["task_id"])
        if s["task_status"] == "processing":
            break
        await asyncio.sleep(0.05)
    assert s["permit"]["token"] and s["permit"]["expires_at"]
    assert (await gateway.status(auth, second["task_id"]))["task_status"] == "pending"  # cap 1
    r = await gateway.http.post(f"/api/v1/tasks/{first['task_id']}/complete", headers=auth,
                                json={"task_result": "done"})
    assert r.json() == {"task_id": first["task_id"], "task_status": "completed"}
    for _ in range(100):
        if (await gateway.status(auth, second["task_id"]))["task_status"] == "processing":
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the freed slot was not given to the next online task")
    done = await gateway.status(auth, first["task_id"])
    assert done["task_result"] == "done" and done["permit"] is None
    assert _log(upstream, "/live") == []  # online tasks never call the API themselves


async def test_only_allowed_headers_reach_the_upstream_and_redirects_are_not_followed(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    await gateway.add_endpoint("hdr", f"{upstream}/hdr",
                               forward_headers=["X-Trace", "X-Mock-Status"])
    auth = await gateway.new_key()
    sent = {"Content-Type": ["application/json"], "X-Trace": ["t1"], "Connection": ["close"],
            "Host": ["evil.example"], "Authorization": ["Bearer gateway-key"],
            "X-API-Key": ["k"], "X-Queue-Permit": ["p"], "Transfer-Encoding": ["chunked"],
            "Bad Name": ["x"]}
    task = await gateway.submit(auth, f"{upstream}/hdr", headers=sent)
    moved = await gateway.submit(auth, f"{upstream}/hdr", headers={"X-Mock-Status": ["302"]})
    await start_dispatcher()
    done, redirected = await gateway.wait_finished(auth, [task["task_id"], moved["task_id"]])
    assert done["task_status"] == "completed"
    assert redirected["task_status"] == "failed" and redirected["result_status_code"] == 302
    first, second = _log(upstream, "/hdr")
    got = first["headers"]
    assert got["content-type"] == "application/json" and got["x-trace"] == "t1"  # type: ignore[index]
    for name in ("authorization", "x-api-key", "x-queue-permit", "transfer-encoding"):
        assert name not in got  # type: ignore[operator]
    assert got["host"] != "evil.example"  # type: ignore[index]
    assert second["status"] == 302 and len(_log(upstream, "/hdr")) == 2


async def test_a_cookie_set_for_one_caller_never_reaches_the_upstream_for_another(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """One client serves every caller: it must keep no cookie jar."""
    await gateway.add_endpoint("jar", f"{upstream}/jar", max_concurrency=1)
    alice, bob = await gateway.new_key(1), await gateway.new_key(2)
    first = await gateway.submit(alice, f"{upstream}/jar",
                                 headers={"X-Mock-Set-Cookie": ["session=alice"]})
    second = await gateway.submit(bob, f"{upstream}/jar")
    await start_dispatcher()
    await gateway.wait_finished(alice, [first["task_id"]])
    await gateway.wait_finished(bob, [second["task_id"]])
    calls = _log(upstream, "/jar")
    assert [c["idempotency_key"] for c in calls] == [first["task_id"], second["task_id"]]
    assert "cookie" not in calls[1]["headers"]  # type: ignore[operator]


async def test_an_answer_over_the_result_limit_fails_its_task_once(
    gateway: Gateway, upstream: str, settings: Settings
) -> None:
    """Kept whole it would weigh on Redis, then not fit its SQL column; tried again it would
    be as large again."""
    await gateway.add_endpoint("big", f"{upstream}/big", max_retries=3)
    auth = await gateway.new_key()
    small, large = [await gateway.submit(auth, f"{upstream}/big",
                                         headers={"X-Mock-Body-Bytes": [str(n)]})
                    for n in (4000, 5000)]
    rt = Runtime(settings.model_copy(update={"max_result_bytes": 4096}), with_dispatcher=True)
    await rt.start()
    try:
        fits, over = await gateway.wait_finished(auth, [small["task_id"], large["task_id"]])
    finally:
        await rt.stop(grace_s=1)
    assert fits["task_status"] == "completed" and len(fits["task_result"]) == 4000
    assert over["task_status"] == "failed" and over["attempts"] == 1
    assert over["task_result"] == "upstream answer over 4096 bytes: not kept"
    assert len(_log(upstream, "/big")) == 2
