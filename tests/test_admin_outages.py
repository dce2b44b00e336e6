"""The admin API when a store fails under it: a write is never left half-done (the Redis
mirrors converge to SQL), every route answers in bounded time, and a delete that a replica has
not seen yet strands no task."""

from __future__ import annotations

import asyncio
import functools
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.registry import RECONCILE_S, cancel_all
from app.db import SQL_REQUEST_TIMEOUT_S
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import MariaDB, RedisServer
from tests.test_storage import open_gateway


async def within(timeout: float, check: Callable[[], Awaitable[Any]], what: str) -> float:
    """Seconds until `check` returns something truthy; fails after `timeout`."""
    began = time.monotonic()
    while not await check():
        assert time.monotonic() - began < timeout, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - began


def kill_9(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()


async def _redis_up(gw: Gateway) -> bool:
    try:
        return bool(await gw.rt.redis.ping())
    except Exception:  # refused, or still loading its append-only file
        return False


class TestRedisOutage:
    """Against a Redis of the test's own, killed with -9 and restarted from its append-only
    file, with two replicas (API processes) on it."""

    @pytest.fixture
    async def replicas(self, settings: Settings, own_redis: RedisServer
                       ) -> AsyncIterator[tuple[Gateway, Gateway]]:
        settings = settings.model_copy(update={"redis_url": own_redis.url})
        async with open_gateway(settings) as one, open_gateway(settings) as two:
            yield one, two

    async def test_a_key_revoked_while_redis_was_down_stops_working_everywhere(
        self, replicas: tuple[Gateway, Gateway], own_redis: RedisServer
    ) -> None:
        one, two = replicas
        await one.add_endpoint("rv", "http://127.0.0.1:9/rv")
        r = await one.http.post("/admin/v1/api-keys", headers=one.admin, json={"user_id": 3})
        key_id, auth = r.json()["id"], {"Authorization": f"Bearer {r.json()['key']}"}
        await within(2, lambda: _submits(two, auth, "http://127.0.0.1:9/rv", 202), "key spread")
        kill_9(own_redis)
        r = await one.http.delete(f"/admin/v1/api-keys/{key_id}", headers=one.admin)
        assert r.status_code == 503, r.text
        own_redis.start()  # same port, same append-only file: the key is still in the mirror
        await within(10, lambda: _redis_up(one), "redis back")
        listed = (await one.http.get("/admin/v1/api-keys", headers=one.admin)).json()
        assert [k["revoked"] for k in listed if k["id"] == key_id] == [True]
        for gw in (one, two):
            took = await within(5, functools.partial(_submits, gw, auth, "http://127.0.0.1:9/rv",
                                                     401), "the revoked key refused")
            print(f"revoked key refused {took:.2f} s after redis answered")

    async def test_an_endpoint_disabled_while_redis_was_down_refuses_submits_everywhere(
        self, replicas: tuple[Gateway, Gateway], own_redis: RedisServer
    ) -> None:
        one, two = replicas
        url = "http://127.0.0.1:9/off"
        await one.add_endpoint("off", url)
        auth = await one.new_key()
        await within(2, lambda: _submits(two, auth, url, 202), "endpoint spread")
        kill_9(own_redis)
        r = await one.http.patch("/admin/v1/endpoints/off", headers=one.admin,
                                 json={"enabled": False})
        assert r.status_code == 503, r.text
        own_redis.start()
        await within(10, lambda: _redis_up(one), "redis back")
        got = (await one.http.get("/admin/v1/endpoints/off", headers=one.admin)).json()
        assert got["enabled"] is False
        for gw in (one, two):
            took = await within(5, functools.partial(_submits, gw, auth, url, 404),
                                "the disabled endpoint refused")
            print(f"disabled endpoint refused {took:.2f} s after redis answered")


async def _submits(gw: Gateway, auth: dict[str, str], url: str, expected: int) -> bool:
    r = await gw.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
    return r.status_code == expected


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
async def test_every_admin_route_answers_503_quickly_while_the_database_hangs(
    settings: Settings, db_url: str, mariadb: MariaDB
) -> None:
    """A paused MariaDB accepts connections and never answers: every admin route must still
    answer, 503 database_unavailable, within its bound on SQL (not after TCP gives up)."""
    bounded = {"database_url": db_url, "sql_timeout_s": SQL_REQUEST_TIMEOUT_S}
    async with open_gateway(settings.model_copy(update=bounded)) as gw:
        await gw.add_endpoint("on", "http://127.0.0.1:9/on")
        await gw.add_endpoint("idle", "http://127.0.0.1:9/idle", enabled=False)
        key_id = (await gw.http.post("/admin/v1/api-keys", headers=gw.admin,
                                     json={"user_id": 1})).json()["id"]
        ep = {"target_url": "http://127.0.0.1:9/new"}
        routes: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", "/admin/v1/endpoints", None),
            ("GET", "/admin/v1/endpoints/on", None),
            ("POST", "/admin/v1/endpoints", {"id": "new", **ep}),
            ("PUT", "/admin/v1/endpoints/on", ep),
            ("PATCH", "/admin/v1/endpoints/on", {"enabled": False}),
            ("DELETE", "/admin/v1/endpoints/on", None),
            ("DELETE", "/admin/v1/endpoints/idle", None),
            ("POST", "/admin/v1/api-keys", {"user_id": 2}),
            ("GET", "/admin/v1/api-keys", None),
            ("DELETE", f"/admin/v1/api-keys/{key_id}", None),
        ]
        assert mariadb.proc is not None
        mariadb.proc.send_signal(signal.SIGSTOP)
        try:
            pid = mariadb.proc.pid
            await within(2, lambda: asyncio.to_thread(_stopped, pid), "the server to stop")
            bound = SQL_REQUEST_TIMEOUT_S + 2

            async def asked(method: str, path: str, body: dict[str, Any] | None
                            ) -> tuple[httpx.Response, float]:
                began = time.monotonic()
                try:  # wait_for: a regression fails here rather than hanging the suite
                    r = await asyncio.wait_for(
                        gw.http.request(method, path, json=body, headers=gw.admin), bound + 5)
                except TimeoutError:
                    pytest.fail(f"{method} {path} did not answer within {bound + 5} s")
                return r, time.monotonic() - began

            # All at once, as operators' requests come: each within its bound all the same.
            answers = await asyncio.gather(*(asked(*route) for route in routes))
            for (method, path, _), (r, took) in zip(routes, answers, strict=True):
                print(f"{method} {path}: {r.status_code} in {took:.2f} s")
                assert r.status_code == 503, (method, path, r.text)
                assert r.json()["error"]["code"] == "database_unavailable"
                assert r.headers["Retry-After"]
                assert took < bound, f"{method} {path} took {took:.2f} s"
        finally:
            mariadb.proc.send_signal(signal.SIGCONT)
        # A 503 leaves a write's outcome unknown (a commit may land once the server runs on),
        # never half-done: whatever SQL holds, the registry every process serves comes to agree.
        took = await within(RECONCILE_S + 5, lambda: _mirrored(gw), "the mirror to agree")
        print(f"registry agreed with SQL {took:.2f} s after the database resumed")


def _stopped(pid: int) -> bool:
    """Every thread of the process is stopped (a signal reaches them one by one)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
               for t in tasks.iterdir())


async def _mirrored(gw: Gateway) -> bool:
    r = await gw.http.get("/admin/v1/endpoints", headers=gw.admin)
    in_sql = {e["id"]: e for e in r.json()}
    assert {"on", "idle"} <= set(in_sql) <= {"on", "idle", "new"}
    return {e.id: e.model_dump() for e in gw.rt.registry.all()} == in_sql


async def test_a_delete_a_replica_has_not_seen_strands_no_task(
    gateway: Gateway, settings: Settings, start_dispatcher: Callable[[], Awaitable[Runtime]],
    upstream: str,
) -> None:
    """A replica whose registry refresh is held (a paused or overloaded process) still
    believes in a deleted endpoint: a submit it takes must not sit in a queue nobody serves."""
    url = f"{upstream}/gone-{uuid.uuid4().hex[:6]}"
    await gateway.add_endpoint("gone", url)
    auth = await gateway.new_key()
    async with open_gateway(settings) as stale:
        await within(2, lambda: _knows(stale, "gone"), "the endpoint to spread")
        await cancel_all(stale.rt._watchers)  # from here on it sees no change
        await start_dispatcher()
        r = await gateway.http.delete("/admin/v1/endpoints/gone", headers=gateway.admin)
        assert r.status_code == 204, r.text
        assert stale.rt.registry.get("gone") is not None  # it still believes in it
        r = await stale.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
        if r.status_code == 202:  # taken: then it must end (run, expire or be cancelled)
            tid = r.json()["task_id"]
            await within(10, lambda: _ended(stale, auth, tid), "the task to end")
        else:
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "endpoint_not_registered"
        assert await gateway.rt.redis.zcard(gateway.rt.keys.queue("gone")) == 0


async def _knows(gw: Gateway, endpoint_id: str) -> bool:
    return gw.rt.registry.get(endpoint_id) is not None


async def _ended(gw: Gateway, auth: dict[str, str], task_id: str) -> bool:
    r = await gw.http.get(f"/api/v1/tasks/{task_id}", headers=auth)
    return r.status_code == 200 and r.json()["task_status"] not in ("pending", "processing")



async def test_a_reconcile_leaves_out_an_endpoint_whose_delete_is_under_way(
    gateway: Gateway,
) -> None:
    """DELETE takes the endpoint out of the registry before its SQL row goes: a reconcile
    in that window must not put it back (a stale replica could then admit into it)."""
    await gateway.add_endpoint("w", "http://127.0.0.1:9/w")
    mirror, keys = gateway.rt.endpoints.mirror, gateway.rt.keys
    await mirror.put("w", None, hold_s=0.5)
    assert not await mirror.reconcile()
    assert not await gateway.rt.redis.hexists(keys.endpoints, "w")
    await asyncio.sleep(0.6)  # the deleting process died: once the hold lapses, SQL wins
    assert await mirror.reconcile()
    assert await gateway.rt.redis.hexists(keys.endpoints, "w")
