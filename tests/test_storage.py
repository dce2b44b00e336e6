"""The task lifecycle on Redis TTLs and SQL (app/lifecycle), run against SQLite and MariaDB with
the same test code: results reach SQL through the outbox, reads deliver them, status falls back
to SQL, pending tasks expire, nothing is lost while SQL is down, the janitor purges in batches."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from app import migrate
from app.core.keys import Keys
from app.core.scripts import LUA_DIR
from app.db import SQL_REQUEST_TIMEOUT_S, TaskResultRow, make_engine, utcnow
from app.lifecycle.expiry import ExpirySweep
from app.lifecycle.janitor import Janitor
from app.lifecycle.results import OutboxWriter, ResultStore
from app.main import create_app
from app.runtime import Runtime, redis_client
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import QGW, MariaDB, free_port

pytestmark = pytest.mark.backends("single", "cluster")

T = TaskResultRow.__table__
Start = Callable[[], Awaitable[Runtime]]


@pytest.fixture
def settings(settings: Settings, db_url: str) -> Settings:
    """Short lifecycle times; the janitor runs only when a test calls it."""
    return settings.model_copy(update={
        "database_url": db_url, "read_ttl_s": 1, "outbox_interval_ms": 50,
        "expiry_interval_ms": 100, "janitor_interval_s": 3600,
    })


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 5.0) -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def rows(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        return {r.task_id: r for r in await conn.execute(select(T))}


async def finish(gw: Gateway, upstream: str, start: Start, path: str, n: int = 1
                 ) -> tuple[dict[str, str], list[str]]:
    """Submit n tasks and let a dispatcher run them; waits on Redis, not on the status route
    (a read by the owner delivers a task)."""
    await gw.add_endpoint(path, f"{upstream}/{path}")
    auth = await gw.new_key(user_id=7)
    ids = [(await gw.submit(auth, f"{upstream}/{path}", body=f"#{i}"))["task_id"]
           for i in range(n)]
    await start()
    redis, keys = gw.rt.redis, gw.rt.keys

    async def done() -> bool:
        states = [await redis.hget(keys.task(t), "status") for t in ids]
        return all(s == "completed" for s in states)

    await eventually(done)
    return auth, ids


async def test_lua_names_the_events_channel_keys_py_names(gateway: Gateway) -> None:
    """The one name a script builds from a key it was given is its endpoint's events channel
    (lua/includes/events.lua); waiters subscribe to the name keys.py gives it."""
    script = (LUA_DIR / "includes" / "events.lua").read_text() + (
        "return {event_channel(KEYS[1]), event_channel(KEYS[2]), event_channel(KEYS[3])}")
    for k in (Keys("p"), Keys("p", cluster=True)):
        found = await gateway.rt.redis.eval(
            script, 3, k.task("0193abc.gen.v2"), k.queue("gen.v2"), k.ratelimit("gen.v2", "x"))
        assert found == [k.events("gen.v2")] * 3


async def test_migration_creates_task_results_with_created_at_index(db_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, db_url)
    await asyncio.to_thread(migrate.upgrade, db_url)  # at head: a no-op
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            def shape(sync_conn: Any) -> tuple[set[str], list[Any]]:
                insp = inspect(sync_conn)
                return ({c["name"] for c in insp.get_columns("task_results")},
                        insp.get_indexes("task_results"))
            columns, indexes = await conn.run_sync(shape)
    finally:
        await engine.dispose()
    assert columns == {c.name for c in T.columns}
    assert any(ix["column_names"] == ["created_at"] for ix in indexes)


async def test_finished_task_gets_a_row_and_a_one_hour_ttl(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    """The done TTL starts once SQL has the row: until then the task has none."""
    _, (tid,) = await finish(gateway, upstream, start_dispatcher, "row")
    got = await eventually(lambda: rows(gateway.rt.engine))
    # The writer commits, then takes the task out of the outbox and sets its TTL: a moment
    # apart, longer on a loaded host (the TTL read between them once saw none).
    outbox = gateway.rt.keys.outbox("row")
    await eventually(lambda: _none_left(gateway, outbox))
    ttl = await gateway.rt.redis.pttl(gateway.rt.keys.task(tid))
    assert 0 < ttl <= gateway.rt.settings.done_ttl_s * 1000
    row = got[tid]
    assert (row.user_id, row.endpoint, row.type, row.status) == (7, "row", "offline", "completed")
    assert row.result_status_code == 200 and row.attempts == 1 and '"#0"' in row.result
    assert row.created_at <= row.started_at <= row.ended_at
    assert not await gateway.rt.redis.zcard(gateway.rt.keys.outbox("row"))


async def _none_left(gateway: Gateway, outbox: str) -> bool:
    return not await gateway.rt.redis.zcard(outbox)


async def test_read_by_owner_cuts_ttl_and_removes_the_row(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    auth, ids = await finish(gateway, upstream, start_dispatcher, "read", n=3)
    await eventually(lambda: _has(gateway.rt.engine, ids))
    s = await gateway.status(auth, ids[0])
    assert s["task_status"] == "completed"
    assert 0 < await gateway.rt.redis.pttl(gateway.rt.keys.task(ids[0])) <= 1000
    # Still served during the read TTL (a retry of the same GET), then gone from both stores.
    assert (await gateway.status(auth, ids[0]))["task_result"] == s["task_result"]

    async def only_unread_left() -> bool:
        return set(await rows(gateway.rt.engine)) == set(ids[1:])

    await eventually(only_unread_left)
    await eventually(lambda: _gone(gateway, auth, ids[0]))


async def test_a_repeated_submit_does_not_deliver_the_first_task(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    """The repeat's answer carries no result: only the owner's read delivers it. Once it has
    been delivered and let go, the repeat names the first task in a 409."""
    await gateway.add_endpoint("again", f"{upstream}/again")
    auth = await gateway.new_key(user_id=7)
    headers = {**auth, "Idempotency-Key": "order-7"}

    async def repeat() -> httpx.Response:
        return await gateway.http.post("/api/v1/tasks", headers=headers,
                                       json={"target_url": f"{upstream}/again", "body": "x"})

    tid = (await repeat()).json()["task_id"]
    await start_dispatcher()
    await eventually(lambda: _has(gateway.rt.engine, [tid]))
    r = await repeat()
    assert r.status_code == 202 and r.json()["task_id"] == tid
    assert r.json()["task_status"] == "completed"
    assert await gateway.rt.redis.pttl(gateway.rt.keys.task(tid)) > 2000  # not cut to read TTL
    await asyncio.sleep(1.2)  # past the read TTL: still there for its owner
    assert (await gateway.status(auth, tid))["task_result"]
    await eventually(lambda: _gone(gateway, auth, tid))  # that read delivered it
    r = await repeat()
    assert r.status_code == 409 and r.json()["error"]["task_id"] == tid


async def _has(engine: AsyncEngine, ids: list[str]) -> bool:
    return set(ids) <= set(await rows(engine))


async def _gone(gw: Gateway, auth: dict[str, str], tid: str) -> bool:
    r = await gw.http.get(f"/api/v1/tasks/{tid}", headers=auth)
    return r.status_code == 404


async def test_status_falls_back_to_sql_with_the_same_fields(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    auth, (tid,) = await finish(gateway, upstream, start_dispatcher, "fallback")
    await eventually(lambda: _has(gateway.rt.engine, [tid]))
    redis, keys = gateway.rt.redis, gateway.rt.keys
    fields = cast("dict[str, str]", await redis.hgetall(keys.task(tid)))  # decode_responses
    from_redis = gateway.rt.queue._view(tid, fields, None, None, None).model_dump(mode="json")
    await redis.delete(keys.task(tid))  # as if its done TTL ran out

    from_sql = await gateway.status(auth, tid)
    assert from_sql == from_redis
    other = await gateway.new_key(user_id=8)
    assert (await gateway.http.get(f"/api/v1/tasks/{tid}", headers=other)).status_code == 404
    r = await gateway.http.post(f"/api/v1/tasks/{tid}/cancel", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["task_status"] == "completed"
    # Read from SQL by its owner, the row is delivered too: gone after the read TTL.
    await eventually(lambda: _gone(gateway, auth, tid))
    assert tid not in await rows(gateway.rt.engine)


async def test_pending_tasks_expire_across_priority_bands(
    settings: Settings, upstream: str
) -> None:
    """The sweep walks each priority band from its head and stops at the first task not due."""
    settings = settings.model_copy(update={"pending_ttl_s": 1})
    async with open_gateway(settings) as gw:
        rt = gw.rt
        await gw.add_endpoint("exp", f"{upstream}/exp")
        auth = await gw.new_key(user_id=7)
        url = f"{upstream}/exp"
        old = [(await gw.submit(auth, url, priority=p))["task_id"] for p in (0, 3, 3)]
        await asyncio.sleep(1.05)
        new = [(await gw.submit(auth, url, priority=p))["task_id"] for p in (0, 3, 1)]
        sweep = ExpirySweep(rt.redis, rt.queue.scripts, rt.keys, rt.registry, rt.queue.ttls)
        assert await sweep.sweep() == 3
        assert set(await rt.redis.zrange(rt.keys.queue("exp"), 0, -1)) == set(new)
        assert await rt.redis.hget(rt.keys.stats("exp"), "expired") == "3"
        states = {t: (await gw.status(auth, t))["task_status"] for t in old + new}
        assert [states[t] for t in old] == ["expired"] * 3
        assert [states[t] for t in new] == ["pending"] * 3
        # Read by its owner, an expired task is no delivered result: a dead letter, it waits
        # in the outbox for SQL, which keeps it for the retention (docs/guides/dead-letters.md).
        assert await rt.redis.pttl(rt.keys.task(old[0])) == -1
        assert await rt.redis.zscore(rt.keys.outbox("exp"), old[0]) is not None
        assert await sweep.sweep() == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_expired_task_never_runs_even_before_the_sweep(
    settings: Settings, upstream: str
) -> None:
    settings = settings.model_copy(update={"pending_ttl_s": 1, "expiry_interval_ms": 600_000})
    async with open_gateway(settings) as gw:
        await gw.add_endpoint("never", f"{upstream}/never")
        auth = await gw.new_key(user_id=7)
        tid = (await gw.submit(auth, f"{upstream}/never"))["task_id"]
        await asyncio.sleep(1.05)
        rt = Runtime(settings, with_dispatcher=True)
        await rt.start()
        try:
            async def expired() -> bool:
                return await gw.rt.redis.hget(gw.rt.keys.task(tid), "status") == "expired"
            await eventually(expired)  # the claim expired it: the sweep is 10 minutes away
            await eventually(lambda: _has(gw.rt.engine, [tid]))
        finally:
            await rt.stop(grace_s=1)
        assert not [e for e in httpx.get(f"{upstream}/_mock/log").json()
                    if e["path"] == "/never"]
        assert (await rows(gw.rt.engine))[tid].status == "expired"
        assert await gw.rt.redis.zcard(gw.rt.keys.queue("never")) == 0


@asynccontextmanager
async def open_gateway(settings: Settings) -> AsyncIterator[Gateway]:
    """The `gateway` fixture, for settings a test makes itself."""
    await asyncio.to_thread(migrate.upgrade, settings.db_url)
    rt = Runtime(settings)
    await rt.start()
    app = create_app(rt, manage=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://gateway") as client:
            yield Gateway(rt, client)
    finally:
        await rt.stop()


class Outage:
    """Takes the test's database away and brings it back: MariaDB is stopped and restarted;
    SQLite's directory is moved away (with the pools emptied, no connection can open it)."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind, self.tmp = kind, tmp_path
        self.server = MariaDB(tmp_path / "mdb") if kind == "mariadb" else None
        self.engines: list[AsyncEngine] = []

    def url(self) -> str:
        if self.server:
            self.server.start()
            return self.server.create_database("qgw")
        (self.tmp / "sql").mkdir()
        return f"sqlite+aiosqlite:///{self.tmp}/sql/qgw.db"

    async def down(self) -> None:
        if self.server:
            await asyncio.to_thread(self.server.stop)
        else:
            (self.tmp / "sql").rename(self.tmp / "away")
        for engine in self.engines:
            await engine.dispose()

    async def up(self) -> None:
        if self.server:
            await asyncio.to_thread(self.server.start)
        else:
            (self.tmp / "away").rename(self.tmp / "sql")

    def close(self) -> None:
        if self.server:
            self.server.stop()



class SqliteOutageCase:
    """Base of a test class whose gateway's SQLite database it takes away (Outage)."""

    @pytest.fixture
    def outage(self, tmp_path: Path) -> Outage:
        return Outage("sqlite", tmp_path)

    @pytest.fixture
    def settings(self, settings: Settings, outage: Outage) -> Settings:
        """Overrides conftest's: a SQLite database the test can take away."""
        return settings.model_copy(update={"database_url": outage.url()})

@pytest.fixture
def outage(db_url: str, tmp_path: Path) -> Iterator[Outage]:
    o = Outage("sqlite" if db_url.startswith("sqlite") else "mariadb", tmp_path)
    yield o
    o.close()


async def test_an_endpoint_goes_only_when_idle_and_its_results_reach_sql_first(
    gateway: Gateway, upstream: str
) -> None:
    """Deleted with tasks waiting, they would never run nor expire; deleted with records in
    its outbox, they would never reach SQL (the writer serves endpoints that exist)."""
    await gateway.add_endpoint("bye", f"{upstream}/bye")
    auth = await gateway.new_key(user_id=7)
    tid = (await gateway.submit(auth, f"{upstream}/bye"))["task_id"]
    r = await gateway.http.delete("/admin/v1/endpoints/bye", headers=gateway.admin)
    assert r.status_code == 409 and r.json()["error"]["code"] == "endpoint_busy"
    assert r.json()["error"]["pending"] == 1
    r = await gateway.http.post(f"/api/v1/tasks/{tid}/cancel", headers=auth)
    assert r.status_code == 200
    r = await gateway.http.delete("/admin/v1/endpoints/bye", headers=gateway.admin)
    assert r.status_code == 204
    assert (await rows(gateway.rt.engine))[tid].status == "cancelled"
    assert not await gateway.rt.redis.zcard(gateway.rt.keys.outbox("bye"))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # Redis's TTLs: any database
async def test_a_call_that_outlasts_the_pending_ttl_keeps_its_task(
    settings: Settings, upstream: str
) -> None:
    """Claimed 2 s into an 8 s pending TTL (plus 1 s done TTL), the call takes 8 s: the task
    must still be there to take its result. (The 6 s left are for the dispatcher to start
    and claim on a loaded host: 2 s were too few for a Cluster at load 8.)"""
    settings = settings.model_copy(update={"pending_ttl_s": 8, "done_ttl_s": 1})
    async with open_gateway(settings) as gw:
        await gw.add_endpoint("long", f"{upstream}/long", timeout_ms=10_000)
        auth = await gw.new_key(user_id=7)
        tid = (await gw.submit(auth, f"{upstream}/long",
                               headers={"X-Mock-Latency-Ms": ["8000"]}))["task_id"]
        await asyncio.sleep(2)
        async with run_dispatcher(settings):
            done = await gw.wait_finished(auth, [tid], timeout=20)
    assert done[0]["task_status"] == "completed" and done[0]["task_result"]


async def test_sql_down_results_wait_in_redis_and_nothing_is_lost(
    settings: Settings, upstream: str, outage: Outage
) -> None:
    settings = settings.model_copy(update={"database_url": outage.url()})
    async with open_gateway(settings) as gw:
        await gw.add_endpoint("out", f"{upstream}/out", max_concurrency=4)
        auth = await gw.new_key(user_id=7)
        dispatchers = [Runtime(settings, with_dispatcher=True) for _ in range(2)]
        for rt in dispatchers:
            await rt.start()
        outage.engines = [gw.rt.engine, *(rt.engine for rt in dispatchers)]
        try:
            before = [(await gw.submit(auth, f"{upstream}/out"))["task_id"] for _ in range(3)]
            await eventually(lambda: _has(gw.rt.engine, before))
            await outage.down()
            # Redis alone: submit, run, finish and status all work.
            during = [(await gw.submit(auth, f"{upstream}/out", body=f"#{i}"))["task_id"]
                      for i in range(20)]

            async def all_done() -> bool:
                got = [await gw.rt.redis.hget(gw.rt.keys.task(t), "status") for t in during]
                return all(s == "completed" for s in got)
            await eventually(all_done)
            outbox = gw.rt.keys.outbox("out")
            assert await gw.rt.redis.zcard(outbox) == 20
            # A status read from SQL cannot be served: 503 with Retry-After, not a hang or 500.
            r = await gw.http.get(f"/api/v1/tasks/{uuid.uuid4().hex}.out", headers=auth)
            assert r.status_code == 503 and r.headers["Retry-After"]
            # However long the outage, no done TTL takes them before SQL has their rows.
            assert {await gw.rt.redis.pttl(gw.rt.keys.task(t)) for t in during} == {-1}
            await outage.up()

            async def all_written() -> bool:
                return await _has(gw.rt.engine, before + during)
            await eventually(all_written, timeout=15)

            async def outbox_empty() -> bool:  # rows are committed before they leave it
                return await gw.rt.redis.zcard(outbox) == 0
            await eventually(outbox_empty, timeout=5)
            got = await rows(gw.rt.engine)
            assert all(got[t].status == "completed" and f'"#{i}"' in got[t].result
                       for i, t in enumerate(during))
            # And status of a task Redis let go is served from SQL again.
            await gw.rt.redis.delete(gw.rt.keys.task(during[0]))
            assert (await gw.status(auth, during[0]))["task_status"] == "completed"
        finally:
            for rt in dispatchers:
                await rt.stop(grace_s=1)


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
async def test_a_database_that_stops_answering_costs_a_503_not_a_hang(
    settings: Settings, upstream: str, tmp_path: Path
) -> None:
    """A paused server accepts connections and never answers: only the caller's own bound on
    each statement keeps status and /readyz from waiting until TCP gives up."""
    server = MariaDB(tmp_path / "mdb")
    server.start()
    try:
        settings = settings.model_copy(update={"database_url": server.create_database("qgw"),
                                               "sql_timeout_s": SQL_REQUEST_TIMEOUT_S})
        async with open_gateway(settings) as gw:
            await gw.add_endpoint("hang", f"{upstream}/hang")
            auth = await gw.new_key(user_id=7)
            tid = (await gw.submit(auth, f"{upstream}/hang"))["task_id"]
            async with run_dispatcher(settings):
                await eventually(lambda: _has(gw.rt.engine, [tid]))
            await gw.rt.redis.delete(gw.rt.keys.task(tid))  # only SQL holds it now
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            try:
                began, bound = time.monotonic(), 2 * SQL_REQUEST_TIMEOUT_S + 2
                # wait_for: a regression must fail here, not hang the suite
                r = await asyncio.wait_for(gw.http.get(f"/api/v1/tasks/{tid}", headers=auth),
                                           bound)
                assert r.status_code == 503 and r.headers["Retry-After"]
                ready = await asyncio.wait_for(gw.http.get("/readyz"), bound)
                # Reported, not fatal: submit does not need the database (test_ops.py).
                assert ready.status_code == 200 and ready.json()["status"] == "degraded"
                again = await asyncio.wait_for(gw.http.get(f"/api/v1/tasks/{tid}",
                                                           headers=auth), bound)
                assert again.status_code == 503
                assert time.monotonic() - began < 3 * SQL_REQUEST_TIMEOUT_S + 2
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert (await gw.status(auth, tid))["task_status"] == "completed"
    finally:
        server.stop()


@asynccontextmanager
async def run_dispatcher(settings: Settings) -> AsyncIterator[Runtime]:
    rt = Runtime(settings, with_dispatcher=True)
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop(grace_s=1)


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
async def test_a_row_the_database_refuses_holds_back_no_other(gateway: Gateway) -> None:
    """Out of range for its column: written without its result (kept in Redis for an operator),
    the batch around it intact,
    and the outbox emptied (a refused row used to stay and block every later batch). The
    records are in the outbox hash of earlier versions: an upgrade drains it too."""
    await gateway.add_endpoint("poison", "http://127.0.0.1:9/poison")
    await eventually(lambda: _as_future(gateway.rt.registry.get("poison")))
    now = int(time.time() * 1000)
    good, bad = f"{uuid.uuid4().hex}.poison", f"{uuid.uuid4().hex}.poison"

    stored = f"{uuid.uuid4().hex}.poison"
    external = json.dumps({"type": "image/png", "bytes": 9, "enc": "external",
                           "ref": f"{stored}/0123"})

    def record(code: int, meta: str = '{"type":"text/plain","bytes":3}') -> str:
        return json.dumps({"user_id": "7", "type": "offline", "status": "completed",
                           "result": "" if "external" in meta else "猫",
                           "result_status_code": str(code), "attempts": "1",
                           "created_at": str(now), "ended_at": str(now), "result_meta": meta})

    outbox = gateway.rt.keys.outbox_legacy("poison")
    await gateway.rt.redis.hset(outbox, mapping={good: record(200), bad: record(70_000),
                                                 stored: record(70_000, external)})
    writer = OutboxWriter(gateway.rt.redis, gateway.rt.keys, gateway.rt.registry,
                          ResultStore(gateway.rt.engine))
    assert await writer.flush() == 3
    got = await rows(gateway.rt.engine)
    assert (got[good].result, got[good].result_status_code) == ("猫", 200)
    assert got[bad].status == "completed" and got[bad].result_status_code is None
    assert got[bad].result.startswith("[result not stored")
    # The reason is no answer: nothing describes it as one (its type, size or encoding);
    # but an answer in the result store keeps its reference (the sweep goes by the rows).
    assert got[good].result_meta and got[bad].result_meta is None
    assert got[stored].result_meta == external
    assert await gateway.rt.redis.hlen(outbox) == 0
    # The result SQL would not take is not thrown away: Redis keeps it for an operator.
    kept = await gateway.rt.redis.hget(gateway.rt.keys.outbox_refused("poison"), bad)
    assert kept and json.loads(kept)["result"] == "猫"


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
async def test_a_row_too_large_to_send_escaped_holds_back_no_other(gateway: Gateway) -> None:
    """A text answer within QGW_RESULT_INLINE_BYTES, but of quotes: escaped, its statement is
    twice its size, over MySQL's packet. The server cut the writer's connection on each try
    (not a refusal), holding every later task of the endpoint out of SQL; it is written
    without its result, kept in Redis for an operator, and the rest goes on."""
    await gateway.add_endpoint("quoted", "http://127.0.0.1:9/quoted")
    await eventually(lambda: _as_future(gateway.rt.registry.get("quoted")))
    now = int(time.time() * 1000)
    good, big = f"{uuid.uuid4().hex}.quoted", f"{uuid.uuid4().hex}.quoted"

    def record(result: str) -> str:
        return json.dumps({"user_id": "7", "type": "offline", "status": "completed",
                           "result": result, "result_status_code": "200", "attempts": "1",
                           "created_at": str(now), "ended_at": str(now)})

    outbox = gateway.rt.keys.outbox_legacy("quoted")
    await gateway.rt.redis.hset(outbox, mapping={good: record("ok"), big: record('"' * 9_000_000)})
    writer = OutboxWriter(gateway.rt.redis, gateway.rt.keys, gateway.rt.registry,
                          ResultStore(gateway.rt.engine))
    assert await writer.flush() == 2
    got = await rows(gateway.rt.engine)
    assert got[good].result == "ok"
    assert got[big].status == "completed" and got[big].result.startswith("[result not stored")
    assert await gateway.rt.redis.hlen(outbox) == 0
    kept = await gateway.rt.redis.hget(gateway.rt.keys.outbox_refused("quoted"), big)
    assert kept and len(json.loads(kept)["result"]) == 9_000_000


async def test_text_outside_latin1_is_kept_in_a_latin1_database(mariadb: MariaDB) -> None:
    """Many servers default to latin1; the migrations convert our tables to utf8mb4."""
    mariadb.execute("CREATE DATABASE latin CHARACTER SET latin1")
    url = mariadb.url("latin")
    await asyncio.to_thread(migrate.upgrade, url)
    engine = make_engine(url)
    try:
        store, now = ResultStore(engine), utcnow()
        await store.upsert([{
            "task_id": "cat.latin", "user_id": 1, "endpoint": "latin", "type": "offline",
            "status": "completed", "result": "猫 🐱", "result_status_code": 200, "attempts": 1,
            "created_at": now, "started_at": now, "ended_at": now}])
        row = await store.get("cat.latin", 1)
        assert row is not None and row.result == "猫 🐱"
    finally:
        await engine.dispose()


async def test_a_row_keeps_its_newest_ending_and_a_retrys_delete_takes_only_the_old(
    db_url: str,
) -> None:
    """A task retried and ended again: a writer that read its first ending and commits late
    does not bring the row back to it; the retry's delete of the first ending (it may land
    late) leaves the second. To the millisecond on both databases (MariaDB's DATETIME(3))."""
    await asyncio.to_thread(migrate.upgrade, db_url)
    engine = make_engine(db_url)
    try:
        store = ResultStore(engine)
        t = utcnow()
        first = t.replace(microsecond=t.microsecond // 1000 * 1000)  # whole ms: Redis's clock
        second = first + timedelta(milliseconds=1)

        def ending(at: datetime, result: str) -> dict[str, Any]:
            return {"task_id": "again.cut", "user_id": 1, "endpoint": "cut", "type": "offline",
                    "status": "failed", "result": result, "result_status_code": 500,
                    "attempts": 1, "created_at": first, "started_at": at, "ended_at": at}
        await store.upsert([ending(first, "first")])
        await store.upsert([ending(second, "second")])
        await store.upsert([ending(first, "first")])  # the late writer
        row = await store.get("again.cut", 1)
        assert row is not None and (row.result, row.ended_at) == ("second", second)
        assert await store.delete(["again.cut"], ended_at=first) == 0  # the late delete
        assert await store.get("again.cut", 1) is not None
        assert await store.delete(["again.cut"], ended_at=second) == 1
    finally:
        await engine.dispose()


async def _as_future(value: Any) -> Any:
    return value


async def _load_rows(store: ResultStore, old: int, new: int, retention_s: int) -> None:
    now = utcnow()
    batch = []
    for i in range(old + new):
        age = timedelta(seconds=retention_s + 60 + i) if i < old else timedelta(seconds=i % 60)
        created = now - age
        batch.append({
            "task_id": f"{i:032x}.jan", "user_id": 1, "endpoint": "jan", "type": "offline",
            "status": "completed", "result": "x", "result_status_code": 200, "attempts": 1,
            "created_at": created, "started_at": created, "ended_at": created,
        })
    for i in range(0, len(batch), 1000):
        await store.upsert(batch[i:i + 1000])


async def test_janitor_deletes_only_old_rows_in_batches_of_at_most_1000(db_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, db_url)
    engines = [make_engine(db_url), make_engine(db_url)]
    try:
        await _load_rows(ResultStore(engines[0]), old=2500, new=300, retention_s=3600)
        janitor = Janitor(engines[0], retention_s=3600, batch=1000)
        stats = await janitor.purge()
        assert stats.rows == 2500 and stats.batches == [1000, 1000, 500]
        async with engines[0].connect() as conn:
            left = await conn.scalar(select(func.count()).select_from(T))
            oldest = await conn.scalar(select(func.min(T.c.created_at)))
        assert left == 300 and oldest > utcnow() - timedelta(seconds=3600)

        # Two janitors at once (two replicas without the lock): the same end state, no error.
        await _load_rows(ResultStore(engines[0]), old=2500, new=300, retention_s=3600)
        both = await asyncio.gather(*(Janitor(e, 3600, 1000).purge() for e in engines))
        assert all(max(s.batches) <= 1000 for s in both if s.batches)
        async with engines[0].connect() as conn:
            assert await conn.scalar(select(func.count()).select_from(T)) == 300
        assert await _uses_created_at_index(engines[0])
    finally:
        for e in engines:
            await e.dispose()


async def _uses_created_at_index(engine: AsyncEngine) -> bool:
    query = ("SELECT task_id FROM task_results WHERE created_at < '2030-01-01' "
             "ORDER BY created_at, task_id LIMIT 1000")  # as the janitor pages
    async with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            plan = [str(r[-1]) for r in await conn.execute(text("EXPLAIN QUERY PLAN " + query))]
        else:  # and no sort of the range: InnoDB's index holds the primary key in order
            plan = [f'{r._mapping["key"]} {r._mapping["Extra"]}'
                    for r in await conn.execute(text("EXPLAIN " + query))]
    return any("ix_task_results_created_at" in p for p in plan) and not any(
        "filesort" in p for p in plan)


async def test_janitor_lock_lets_one_replica_work(gateway: Gateway) -> None:
    rt = gateway.rt
    janitor = Janitor(rt.engine, 3600, 1000, rt.redis, rt.keys)
    assert await janitor.run_once() is not None  # free: it runs
    lock = rt.redis.lock(rt.keys.lock("janitor"), timeout=10)
    assert await lock.acquire(blocking=False)
    try:
        assert await janitor.run_once() is None  # another replica holds it
    finally:
        await lock.release()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # Redis's part
async def test_a_row_outlives_its_retention_while_redis_holds_its_task(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    """A retention shorter than the done TTL: the rows of tasks Redis still holds stay (their
    hashes name them, and their result objects), and go on a pass after Redis let them go.
    One row a batch: the held rows ahead do not stop the pass from reaching the others."""
    _, ids = await finish(gateway, upstream, start_dispatcher, "held", n=3)
    rt = gateway.rt
    await eventually(lambda: _has(rt.engine, ids))
    janitor = Janitor(rt.engine, 3600, 1, rt.redis, rt.keys)
    await rt.redis.pexpire(rt.keys.task(ids[2]), 1)  # its done TTL runs out
    await eventually(lambda: _expired(gateway, ids[2]))
    stats = await janitor.purge(cutoff=utcnow() + timedelta(seconds=1))
    assert stats.rows == 1 and set(await rows(rt.engine)) == set(ids[:2])
    for tid in ids[:2]:  # still Redis's (not read: a read would schedule the row's end)
        assert await rt.redis.hget(rt.keys.task(tid), "status") == "completed"
        await rt.redis.pexpire(rt.keys.task(tid), 1)
        await eventually(lambda: _expired(gateway, tid))  # noqa: B023 - awaited at once
    assert (await janitor.purge(cutoff=utcnow() + timedelta(seconds=1))).rows == 2
    assert await rows(rt.engine) == {}


async def _expired(gateway: Gateway, tid: str) -> bool:
    return not await gateway.rt.redis.exists(gateway.rt.keys.task(tid))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # Redis's part
async def test_the_janitor_waits_while_redis_does_not_answer(
    gateway: Gateway, upstream: str, start_dispatcher: Start
) -> None:
    """No row goes while the hashes that may name it cannot be checked."""
    _, (tid,) = await finish(gateway, upstream, start_dispatcher, "waits")
    rt = gateway.rt
    await eventually(lambda: _has(rt.engine, [tid]))
    nobody = redis_client(f"redis://127.0.0.1:{free_port()}", 0.5)  # refuses at once
    janitor = Janitor(rt.engine, 3600, 1000, nobody, rt.keys)
    try:
        stats = await janitor.purge(cutoff=utcnow() + timedelta(seconds=1))
    finally:
        await nobody.aclose()
    assert stats.rows == 0 and tid in await rows(rt.engine)


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
def test_qgw_migrate_on_mariadb_from_three_replicas_at_once(db_url: str) -> None:
    """MySQL's DDL is not transactional: without a lock, one of several replicas starting
    together failed with 'table already exists'."""
    env = {**os.environ, "QGW_DATABASE_URL": db_url}
    procs = [subprocess.Popen([*QGW, "migrate"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        assert "database at head" in out and ":***@" not in out  # root has no password


def test_serve_refuses_an_unmigrated_database_when_auto_migrate_is_off(tmp_path: Path) -> None:
    env = {**os.environ, "QGW_AUTO_MIGRATE": "false", "QGW_DATA_DIR": str(tmp_path),
           "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/empty.db"}
    proc = subprocess.run([*QGW, "serve", "--port", str(free_port())], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    head = ScriptDirectory.from_config(migrate._config(env["QGW_DATABASE_URL"])).get_current_head()
    assert "run `qgw migrate`" in proc.stderr and f"needs {head}" in proc.stderr


def test_the_head_is_the_newest_migration_files_number() -> None:
    """app/migrate.py finds the head from the files' names, without Alembic: each file's
    revision is its number, and the newest number is Alembic's head."""
    script = ScriptDirectory.from_config(migrate._config("sqlite://"))
    assert migrate.head() == script.get_current_head()
    revisions = list(script.walk_revisions())
    assert len(revisions) >= 15
    for rev in revisions:
        assert Path(str(rev.path)).name.startswith(f"{rev.revision}_"), rev.path


def test_a_start_at_head_leaves_alembic_alone(db_url: str) -> None:
    """Every start migrates: a fresh database through Alembic, one at head (nearly every
    start) by reading its revision (0.25 s of CPU less a start)."""
    code = ("import sys; from app import migrate; migrate.upgrade(sys.argv[1]); "
            "print('alembic' in sys.modules, migrate.pending(sys.argv[1]))")

    def start() -> str:
        return subprocess.run([sys.executable, "-c", code, db_url], capture_output=True,
                              text=True, timeout=60, check=True).stdout.strip()

    assert start() == "True None"  # migrated by Alembic
    assert start() == "False None"  # found at head


def test_a_database_that_cannot_be_read_is_not_taken_for_an_empty_one(tmp_path: Path) -> None:
    """Locked (or unreachable, or not allowed), it is its own error, as Alembic gave it: not
    "at revision none (empty)", which would send the operator to migrate a full database."""
    url = f"sqlite+aiosqlite:///{tmp_path}/qgw.db"
    migrate.upgrade(url)
    held = sqlite3.connect(tmp_path / "qgw.db", isolation_level=None)
    held.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(OperationalError, match="database is locked"):
            migrate.pending(url + "?timeout=0.2")
    finally:
        held.execute("ROLLBACK")
        held.close()
    assert migrate.pending(url) is None
    with pytest.raises(FileNotFoundError, match=r"no directory .*absent"):
        migrate.upgrade(f"sqlite+aiosqlite:///{tmp_path}/absent/qgw.db")
