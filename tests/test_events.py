"""Waiting without polling: `?wait=` and the SSE stream are woken by status events
(app/queue/events.py, app/routes/follow.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.queue.events import TaskEvents
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import RedisServer
from tests.test_faults import _answers, eventually

StartApi = Callable[[], Awaitable[str]]
StartDispatcher = Callable[[], Awaitable[Runtime]]


async def commands(redis: Redis) -> int:
    """Commands Redis has served so far (INFO commandstats, summed)."""
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def events(stream: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The `event: status` payloads of an SSE response, as they arrive."""
    kind = None
    async for line in stream.aiter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            assert kind == "status", line
            yield json.loads(line[6:])


@pytest.mark.backends("single", "cluster")
async def test_waiting_callers_cost_redis_nothing_until_their_task_changes(
    gateway: Gateway, upstream: str, start_dispatcher: StartDispatcher
) -> None:
    url = f"{upstream}/idle-wait"
    await gateway.add_endpoint("idle-wait", url)
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(30)]

    async def wait(tid: str) -> tuple[dict[str, Any], float]:
        r = await gateway.http.get(f"/api/v1/tasks/{tid}?wait=20", headers=auth)
        assert r.status_code == 200, r.text
        return r.json(), time.monotonic()

    # What the idle gateway's own timers (registry, presence, sweeps) send in 1.5 s: the
    # waiters must add nothing to it (polling every 100 ms, 30 of them would add 450).
    before = await commands(gateway.rt.redis)
    await asyncio.sleep(1.5)
    idle = await commands(gateway.rt.redis) - before - 1  # our INFO
    waiters = [asyncio.create_task(wait(t)) for t in ids]
    # All of them waiting, and past the one re-read each that the subscription's confirmation
    # brings (on a loaded machine it may come after half a second): the count settles. Waiters
    # that polled would never let it settle, and are caught below all the same.
    before, settle_by = await commands(gateway.rt.redis), time.monotonic() + 10
    while time.monotonic() < settle_by:
        await asyncio.sleep(0.5)
        now = await commands(gateway.rt.redis)
        quiet, before = now - before - 1 < idle / 3 + 5, now
        if quiet:
            break
    await asyncio.sleep(1.5)
    spent = await commands(gateway.rt.redis) - before - 1
    assert spent < idle + 10, f"{spent} Redis commands in 1.5 s with 30 waiters, {idle} without"
    assert not any(w.done() for w in waiters)

    started = time.monotonic()
    await start_dispatcher()
    answers = await asyncio.gather(*waiters)
    assert {a["task_status"] for a, _ in answers} <= {"processing", "completed"}
    assert max(at for _, at in answers) - started < 5  # woken, not timed out at 20 s


async def test_a_change_while_the_listener_reconnects_is_not_missed(
    gateway: Gateway, upstream: str
) -> None:
    """Redis drops the listener's connection; the task is cancelled before it subscribes
    again (that message is never heard). The waiter still answers `cancelled` at once."""
    url = f"{upstream}/relisten"
    await gateway.add_endpoint("relisten", url)
    auth = await gateway.new_key()
    tid = (await gateway.submit(auth, url))["task_id"]
    waiter = asyncio.create_task(
        gateway.http.get(f"/api/v1/tasks/{tid}?wait=20", headers=auth))
    await asyncio.sleep(0.5)
    assert await gateway.rt.redis.client_kill_filter(_type="pubsub") >= 1
    r = await gateway.http.post(f"/api/v1/tasks/{tid}/cancel", headers=auth)
    assert r.status_code == 200, r.text
    started = time.monotonic()
    answer = await asyncio.wait_for(waiter, 10)
    assert answer.json()["task_status"] == "cancelled"
    assert time.monotonic() - started < 5


@pytest.mark.backends("single", "cluster")
async def test_events_stream_sends_each_status_once_and_ends_after_the_last(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    url = f"{upstream}/sse"
    await gateway.add_endpoint("sse", url)
    auth = await gateway.new_key()
    tid = (await gateway.submit(auth, url, body="hello",
                                headers={"X-Mock-Latency-Ms": ["300"]}))["task_id"]
    base = await start_api()
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async with http.stream("GET", f"/api/v1/tasks/{tid}/events", headers=auth) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            async for ev in events(stream):
                seen.append(ev)
                if len(seen) == 1:
                    await start_dispatcher()
    assert [e["task_status"] for e in seen] == ["pending", "processing", "completed"]
    assert seen[-1]["task_id"] == tid and json.loads(seen[-1]["task_result"])["ok"] is True
    assert seen[-1] == await gateway.status(auth, tid)  # the same JSON as status


async def test_events_stream_has_the_access_rules_of_status(
    gateway: Gateway, upstream: str, start_api: StartApi
) -> None:
    url = f"{upstream}/sse-auth"
    await gateway.add_endpoint("sse-auth", url)
    owner, other = await gateway.new_key(1), await gateway.new_key(2)
    tid = (await gateway.submit(owner, url))["task_id"]
    base = await start_api()
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for headers, status in (({}, 401), (other, 404)):
            r = await http.get(f"/api/v1/tasks/{tid}/events", headers=headers)
            assert r.status_code == status and "error" in r.json(), r.text
        r = await http.get(f"/api/v1/tasks/{'0' * 32}.sse-auth/events", headers=owner)
        assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found"
        await http.post(f"/api/v1/tasks/{tid}/cancel", headers=owner)
        r = await http.get(f"/api/v1/tasks/{tid}/events", headers=owner)  # ended: one event
        assert r.status_code == 200 and r.text.count("event: status") == 1
        assert '"task_status": "cancelled"' in r.text


@pytest.mark.usefixtures("own_redis")
class TestRedisOutage:
    @pytest.fixture
    def settings(self, own_redis: RedisServer, tmp_path: Path) -> Settings:
        """Overrides conftest's for this class: `gateway`, `env` and friends use it too."""
        return Settings(
            redis_url=own_redis.url, database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db",
            data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
            permit_secret="test-permit-secret", lease_ms=3000, reap_interval_ms=200,
        )

    async def test_events_stream_survives_a_redis_restart_and_sends_the_end(
        self, gateway: Gateway, own_redis: RedisServer, upstream: str, start_api: StartApi,
        start_dispatcher: StartDispatcher,
    ) -> None:
        """Redis stops while the task runs and starts again after the call has ended: the
        result is recorded after the restart, and the open stream still delivers it."""
        url = f"{upstream}/sse-outage"
        await gateway.add_endpoint("sse-outage", url)
        auth = await gateway.new_key()
        tid = (await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["500"]}))[
            "task_id"]
        base = await start_api()
        seen: list[str] = []
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("GET", f"/api/v1/tasks/{tid}/events",
                                   headers=auth) as stream:
                async for ev in events(stream):
                    seen.append(ev["task_status"])
                    if seen == ["pending"]:
                        await start_dispatcher()
                    elif seen[-1] == "processing":
                        own_redis.stop()
                        await asyncio.sleep(2)  # the call ends meanwhile; its ack waits
                        own_redis.start()
                        await eventually(lambda: _answers(gateway), 5, "redis to load")
        assert seen == ["pending", "processing", "completed"]



async def test_a_second_endpoint_watched_while_the_first_subscribes_is_heard(
    gateway: Gateway,
) -> None:
    """Two endpoints watched at once in a fresh process: the second's channel is subscribed
    too (it came while the first SUBSCRIBE was connecting), and its changes wake its waiter."""
    events = TaskEvents(gateway.rt.redis, gateway.rt.keys)
    try:
        with events.watch("a1.epa") as a:
            await asyncio.sleep(0)  # the listener is connecting
            with events.watch("b1.epb") as b:
                assert await a.changed(5) and await b.changed(5)  # each one's subscription
                await gateway.rt.redis.publish(gateway.rt.keys.events("epb"), "b1.epb")
                assert await b.changed(5)
    finally:
        await events.stop()
