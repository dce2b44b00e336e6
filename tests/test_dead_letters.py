"""Dead letters: `failed` and `expired` tasks stay, request and all, for QGW_DB_RETENTION_S
whether or not their owner read them; an operator finds them across endpoints
(GET /admin/v1/tasks) and replays or cancels them in bulk, from SQL once Redis let them go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import httpx
import pytest

from app.lifecycle.outbox import Outbox
from app.lifecycle.records import to_ms
from app.queue import operator
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import mock_log
from tests.test_cli import answer, aqgw, refusal

StartDispatcher = Callable[[], Awaitable[Runtime]]
StartApi = Callable[[], Awaitable[str]]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Short read and done TTLs: Redis lets a task go seconds after it ends, as it would an
    hour later; the outbox writer runs often."""
    return settings.model_copy(update={"read_ttl_s": 1, "done_ttl_s": 1,
                                       "outbox_interval_ms": 100})


async def _admin(gateway: Gateway, method: str, path: str, status: int = 200, **kw: Any) -> Any:
    r = await gateway.http.request(method, path, headers=gateway.admin, **kw)
    assert r.status_code == status, r.text
    return r.json() if r.content else None


async def _gone_from_redis(gateway: Gateway, task_id: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while await gateway.rt.redis.exists(gateway.rt.keys.task(task_id)):
        assert time.monotonic() < deadline, "Redis kept the task"
        await asyncio.sleep(0.1)


def _ms(rfc3339: str) -> str | None:
    """A status field's time as a row's (app/lifecycle/records.py to_ms)."""
    return to_ms(datetime.fromisoformat(rfc3339).replace(tzinfo=None))


async def _calls(upstream: str, body: str, n: int, timeout: float = 15) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        calls = [c for c in mock_log(upstream) if c["body"] == body]
        if len(calls) >= n or time.monotonic() > deadline:
            return calls
        await asyncio.sleep(0.05)


@pytest.mark.backends("single", "cluster")
async def test_a_failure_its_owner_read_stays_and_is_replayed_from_sql(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    """The issue's reproduction: `--max-retries 0`, submit, the owner reads the failure; once
    Redis let it go the operator still lists it, shows its request and retries it."""
    url = f"{fresh_upstream}/dead"
    await gateway.add_endpoint("dead-api", url, max_retries=0)
    auth = await gateway.new_key(user_id=4)
    sent = await gateway.submit(auth, url, body="payload", priority=3,
                                headers={"X-Mock-Status": ["500"]})
    tid = sent["task_id"]
    await start_dispatcher()
    (failed,) = await gateway.wait_finished(auth, [tid])  # read by its owner
    assert failed["task_status"] == "failed"
    assert (await gateway.status(auth, tid))["task_status"] == "failed"
    await _gone_from_redis(gateway, tid)
    await asyncio.sleep(2)  # past the read TTL: a delivered row would be deleted by now

    listed = await _admin(gateway, "GET", "/admin/v1/endpoints/dead-api/tasks",
                          params={"status": "failed"})
    assert [t["task_id"] for t in listed["tasks"]] == [tid]
    shown = await _admin(gateway, "GET", f"/admin/v1/tasks/{tid}")
    assert shown["task_status"] == "failed" and shown["attempts"] == 1
    assert shown["result_status_code"] == 500
    req = shown["request"]
    assert req["body"] == "payload" and req["method"] == "POST" and req["url"] == url
    assert req["headers"] == {"X-Mock-Status": ["500"]} and req["priority"] == 3

    retried = await _admin(gateway, "POST", f"/admin/v1/tasks/{tid}/retry")
    assert retried["task_status"] == "pending"
    assert len(await _calls(fresh_upstream, "payload", 2)) == 2  # it ran again, as sent
    (again,) = await gateway.wait_finished(auth, [tid])
    assert again["task_status"] == "failed" and again["attempts"] == 1
    assert again["created_at"] == failed["created_at"]  # submitted once, as from Redis


async def test_a_retrys_late_delete_of_the_old_ending_keeps_the_new_one(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry deletes the task's old row as a best effort, bounded: abandoned, that delete can
    still land after the task ran again and its new ending reached SQL. It deletes only what
    is the retry's ending (its time), so the new ending stays (a delete by id alone took it)."""
    url = f"{fresh_upstream}/again"
    await gateway.add_endpoint("again-api", url, max_retries=0)
    auth = await gateway.new_key(user_id=5)
    tid = (await gateway.submit(auth, url, body="twice",
                                headers={"X-Mock-Status": ["500"]}))["task_id"]
    await start_dispatcher()
    (first,) = await gateway.wait_finished(auth, [tid])
    late: list[datetime | None] = []  # the retry's delete, held back: it lands below

    async def held_back(queue: Any, task_id: str, ended_at: datetime | None) -> None:
        late.append(ended_at)
    monkeypatch.setattr(operator, "_forget_row", held_back)
    retried = await _admin(gateway, "POST", f"/admin/v1/tasks/{tid}/retry")
    assert retried["task_status"] == "pending" and len(late) == 1
    assert late[0] is not None and to_ms(late[0]) == _ms(first["ended_at"])  # the old ending
    (again,) = await gateway.wait_finished(auth, [tid])
    assert again["task_status"] == "failed"
    results = gateway.rt.queue.results
    assert results is not None
    new_end = _ms(again["ended_at"])
    deadline = time.monotonic() + 15
    while (row := await results.get(tid, 5)) is None or to_ms(row.ended_at) != new_end:
        assert time.monotonic() < deadline, ("the new ending never reached SQL", row, new_end)
        await asyncio.sleep(0.1)

    monkeypatch.undo()
    await operator._forget_row(gateway.rt.queue, tid, late[0])
    kept = await results.get(tid, 5)
    assert kept is not None and to_ms(kept.ended_at) == new_end and kept.status == "failed"


@pytest.mark.backends("single", "cluster")
async def test_an_ending_that_came_after_the_writer_read_stays_in_the_outbox(
    gateway: Gateway,
) -> None:
    """The writer reads a failed task, a retry runs it again and it fails again, then the
    writer's commit of the first ending comes back: the task used to leave the outbox then,
    its second ending never reaching SQL (whose row kept the first). Only the ending the writer
    read leaves it now."""
    rt, e = gateway.rt, "race"
    tid, other = f"{'ab' * 16}.{e}", f"{'cd' * 16}.{e}"  # `other` ends once
    outbox, task = rt.keys.outbox(e), rt.keys.task(tid)
    first, second = (int(time.time() * 1000) + i for i in (0, 100))  # ms: done TTL from there
    for t in (tid, other):
        await rt.redis.hset(rt.keys.task(t), mapping={
            "user_id": 1, "status": "failed", "type": "offline", "attempts": 1,
            "created_at": first - 10, "ended_at": first, "result": "first"})
        await rt.redis.zadd(outbox, {t: first})
    box = Outbox(rt.redis, rt.keys)
    waiting = await box.waiting(e, 10)
    records = await box.fetch(waiting)
    record = records[tid]
    assert record is not None and record["ended_at"] == str(first)
    assert len(records) == 2

    await rt.redis.hset(task, mapping={"ended_at": second, "result": "second"})  # ended again
    await rt.redis.zadd(outbox, {tid: second})
    await box.saved(waiting, records, 60_000)
    assert await rt.redis.zscore(outbox, tid) == second  # the second ending is written next
    assert await rt.redis.pttl(task) == -1  # and keeps its hash until then
    assert await rt.redis.zscore(outbox, other) is None  # the one that ended once has left
    assert await rt.redis.pttl(rt.keys.task(other)) > 0

    records = await box.fetch(await box.waiting(e, 10))  # the next round: this one leaves
    await box.saved(waiting, records, 60_000)
    assert await rt.redis.zscore(outbox, tid) is None
    assert await rt.redis.pttl(task) > 0


@pytest.mark.backends("single", "cluster")
async def test_a_failed_proxied_request_is_not_retried(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
    start_api: StartApi,
) -> None:
    """Its answer went to its caller's connection, long closed: an operator's retry (one task,
    from Redis or from SQL, or in bulk) is a 409 that says so, and nothing is called again."""
    await gateway.add_endpoint("dl-proxy", f"{fresh_upstream}/p", proxy=True, max_retries=0)
    auth = await gateway.new_key(user_id=5)
    base = await start_api()
    await start_dispatcher()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/dl-proxy/x", content="proxied",
                            headers={"X-Mock-Status": "500"})
    assert r.status_code == 500
    tid = r.headers["x-queue-task-id"]
    assert (await gateway.status(auth, tid))["task_status"] == "failed"

    async def refused(path: str, **kw: Any) -> dict[str, Any]:
        r = await gateway.http.post(path, headers=gateway.admin, **kw)
        assert r.status_code == 409, r.text
        error: dict[str, Any] = r.json()["error"]
        return error

    err = await refused(f"/admin/v1/tasks/{tid}/retry")  # from Redis
    assert err["code"] == "proxy_not_retryable" and err["task_status"] == "failed"
    assert "caller" in err["message"]
    await _gone_from_redis(gateway, tid)
    err = await refused(f"/admin/v1/tasks/{tid}/retry")  # from its SQL row
    assert err["code"] == "proxy_not_retryable" and err["task_type"] == "proxy"
    res = await _admin(gateway, "POST", "/admin/v1/tasks/retry",
                       json={"status": "failed", "endpoint": "dl-proxy"})
    assert res == {"matched": 1, "retried": 0, "skipped": {"proxy_not_retryable": 1},
                   "more": False}
    assert len(await _calls(fresh_upstream, "proxied", 2, timeout=1)) == 1


async def test_search_every_endpoint_and_retry_or_cancel_in_bulk(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: StartDispatcher,
) -> None:
    for e in ("dl-a", "dl-b", "dl-gone"):
        await gateway.add_endpoint(e, f"{fresh_upstream}/{e}", max_retries=0)
    await gateway.add_endpoint("dl-hold", f"{fresh_upstream}/dl-hold", max_concurrency=1)
    auth = await gateway.new_key(user_id=9)
    fail = {"X-Mock-Status": ["500"]}
    failed = {e: [(await gateway.submit(auth, f"{fresh_upstream}/{e}", body=f"{e}-{i}",
                                        headers=fail))["task_id"] for i in range(n)]
              for e, n in (("dl-a", 3), ("dl-b", 2), ("dl-gone", 1))}
    all_failed = [t for ids in failed.values() for t in ids]
    ok = (await gateway.submit(auth, f"{fresh_upstream}/dl-a", body="fine"))["task_id"]
    await start_dispatcher()
    await gateway.wait_finished(auth, [ok, *all_failed])
    await _admin(gateway, "DELETE", "/admin/v1/endpoints/dl-gone", 204)

    async def search(**params: Any) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = []
        cursor = None
        for _ in range(20):
            page = await _admin(gateway, "GET", "/admin/v1/tasks", params={
                **params, "limit": 2, **({"cursor": cursor} if cursor else {})})
            tasks += page["tasks"]
            cursor = page["next_cursor"]
            if cursor is None:
                return tasks
        raise AssertionError("the pages never ended")

    every = await search(status="failed")
    assert sorted(t["task_id"] for t in every) == sorted(all_failed)
    ends = [(t["ended_at"], t["task_id"]) for t in every]
    assert ends == sorted(ends, reverse=True)  # newest first, no repeats across pages
    assert {t["endpoint"] for t in every} == {"dl-a", "dl-b", "dl-gone"}
    assert all('"echo"' in t["last_error"] and t["result_status_code"] == 500 for t in every)
    # Two calls of one endpoint may end in either order: newest ending first, whichever.
    by_b = [(t["ended_at"], t["task_id"]) for t in await search(status="failed", endpoint="dl-b")]
    assert sorted(tid for _, tid in by_b) == sorted(failed["dl-b"])
    assert by_b == sorted(by_b, reverse=True)
    # Any ending: the completed one its owner read goes once its read TTL (1 s) is up and the
    # writer's next pass deletes delivered rows (its row may have been written before the read).
    deadline = time.monotonic() + 30
    while (found := {t["task_id"] for t in await search()}) != set(all_failed):
        assert found == {*all_failed, ok}, found
        assert time.monotonic() < deadline, f"the read completed task {ok} is still listed"
        await asyncio.sleep(0.2)
    one = failed["dl-a"][1]
    assert one in [t["task_id"] for t in await search(id=one[:8])]
    assert [t["task_id"] for t in await search(id=one[:34])] == [one]
    assert [t["task_id"] for t in await search(id=one)] == [one]
    assert await search(status="failed", since="2999-01-01T00:00:00Z") == []
    assert len(await search(status="failed", until="2999-01-01T00:00:00+02:00")) == 6
    # Times whose UTC lies past what a datetime holds are the first and last there are (they
    # answered 500): everything from year 1, nothing from 9999.
    assert len(await search(status="failed", since="0001-01-01T00:00:00+05:00")) == 6
    assert await search(status="failed", since="9999-12-31T23:59:59-05:00") == []

    # Bad filters: a clear 4xx each.
    for params in ({"status": "bogus"}, {"id": "NOT-AN-ID"}, {"cursor": "x"},
                   {"since": "2030-01-01T00:00:00Z", "until": "2020-01-01T00:00:00Z"},
                   {"status": "pending"}, {"since": "yesterday"}):
        r = await gateway.http.get("/admin/v1/tasks", headers=gateway.admin, params=params)
        assert r.status_code == 422 and "error" in r.json(), (params, r.text)
    for body, code, err in (
            ({"status": "completed"}, 422, "bad_filter"), ({}, 422, "bad_filter"),
            ({"status": "failed", "colour": "red"}, 422, None),
            ({"status": "failed", "endpoint": "dl-a", "since": "2999-01-01T00:00:00Z"}, 404,
             "no_tasks_match"),
            ({"status": "failed", "endpoint": "dl-gone"}, 409, "endpoint_not_registered")):
        r = await gateway.http.post("/admin/v1/tasks/retry", headers=gateway.admin, json=body)
        assert r.status_code == code, (body, r.text)
        assert err is None or r.json()["error"]["code"] == err
    gone = await gateway.http.post(f"/admin/v1/tasks/{failed['dl-gone'][0]}/retry",
                                   headers=gateway.admin)
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "endpoint_not_registered"

    # Retried in bulk: each runs again with its own request.
    res = await _admin(gateway, "POST", "/admin/v1/tasks/retry",
                       json={"status": "failed", "endpoint": "dl-b"})
    assert res == {"matched": 2, "retried": 2, "skipped": {}, "more": False}
    for i in range(2):
        assert len(await _calls(fresh_upstream, f"dl-b-{i}", 2)) == 2
    res = await _admin(gateway, "POST", "/admin/v1/tasks/retry", json={"status": "failed"})
    # dl-b's two may have failed again by now (or one of them): matched with the rest or not.
    assert 4 <= res["matched"] <= 6 and res["retried"] == res["matched"] - 1
    assert res["skipped"] == {"endpoint_not_registered": 1}

    # Cancelled in bulk: the running call is aborted, the waiting ones leave the line.
    held = [(await gateway.submit(auth, f"{fresh_upstream}/dl-hold", body=f"h{i}",
                                  headers={"X-Mock-Latency-Ms": ["30000"]}))["task_id"]
            for i in range(3)]
    await _calls(fresh_upstream, "h0", 1)
    res = await _admin(gateway, "POST", "/admin/v1/tasks/cancel", json={"endpoint": "dl-hold"})
    assert res == {"matched": 3, "cancelled": 3, "skipped": {}, "more": False}
    assert [s["task_status"] for s in await gateway.wait_finished(auth, held)] == \
        ["cancelled"] * 3
    (call,) = await _calls(fresh_upstream, "h0", 1)
    assert call["closed"] is not None
    r = await gateway.http.post("/admin/v1/tasks/cancel", headers=gateway.admin,
                                json={"endpoint": "dl-hold"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_tasks_match"
    r = await gateway.http.post("/admin/v1/tasks/cancel", headers=gateway.admin,
                                json={"status": "failed"})
    assert r.status_code == 422


async def test_the_cli_lists_shows_and_retries_dead_letters(
    gateway: Gateway, env: dict[str, str], fresh_upstream: str,
    start_dispatcher: StartDispatcher,
) -> None:
    """The issue's steps with `qgw`: the failure its owner read is listed, shown and retried
    from the shell once Redis let it go; filters and bad times."""
    url = f"{fresh_upstream}/cli-dead"
    answer(await aqgw(env, "endpoints", "add", "dead-api", url, "--max-retries", "0",
                      "--forward-headers", "X-Mock-Status"))
    await asyncio.sleep(1.2)  # the in-process gateway has heard of it (registry SPREAD_S)
    auth = await gateway.new_key(user_id=3)
    tid = (await gateway.submit(auth, url, body="again", headers={"X-Mock-Status": ["503"]})
           )["task_id"]
    await start_dispatcher()
    (failed,) = await gateway.wait_finished(auth, [tid])
    assert failed["task_status"] == "failed"
    await _gone_from_redis(gateway, tid)

    for args in (("dead-api", "--status", "failed"),
                 ("--status", "failed", "--endpoint", "dead-api", "--since", "1h"),
                 ("--status", "failed", "--id", tid[:6])):
        listed = answer(await aqgw(env, "tasks", "list", *args))
        assert [t["task_id"] for t in listed["tasks"]] == [tid], args
    assert answer(await aqgw(env, "tasks", "list", "--status", "failed", "--until", "1h"))[
        "tasks"] == []
    shown = answer(await aqgw(env, "tasks", "show", tid))
    assert shown["request"]["body"] == "again" and shown["attempts"] == 1
    assert "ISO 8601" in refusal(await aqgw(env, "tasks", "list", "--since", "last week"), 2)
    # An age past the year 1 is all of time; a wildcard is no id (it matched every task).
    assert [t["task_id"] for t in answer(await aqgw(
        env, "tasks", "list", "--status", "failed", "--since", "9999999d"))["tasks"]] == [tid]
    for wild in ("?", "*", "[0-9]", "0?", "%"):
        assert "beginning of a task id" in refusal(
            await aqgw(env, "tasks", "list", "--status", "failed", "--id", wild), 2), wild
    assert "a task id, or a filter" in refusal(await aqgw(env, "tasks", "retry"), 2)
    assert "no task matches" in refusal(await aqgw(env, "tasks", "retry", "--status", "expired",
                                                   "--endpoint", "dead-api"))
    res = answer(await aqgw(env, "tasks", "retry", "--status", "failed", "--endpoint", "dead-api"))
    assert res["matched"] == 1 and res["retried"] == 1
    assert len(await _calls(fresh_upstream, "again", 2)) == 2


async def test_a_bulk_cancel_without_a_filter_is_refused(gateway: Gateway) -> None:
    """An empty filter would cancel every task of every endpoint: the API refuses it."""
    r = await gateway.http.post("/admin/v1/tasks/cancel", headers=gateway.admin, json={})
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_filter", r.text
