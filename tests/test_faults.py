"""Nothing lost: dispatchers killed or stopped mid-call, Redis restarted, a flaky upstream.

Real processes throughout: `qgw dispatcher`, the mock upstream, and Redis.  Tests that stop
Redis run against their own server (class `TestRedisOutage`), so the session's stays up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import RedisError

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import QGW, TLS, RedisServer, mock_log, mock_upstream, read_until, stop

pytestmark = pytest.mark.backends("single", "cluster")

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def slow_upstream() -> Iterator[str]:
    with mock_upstream("--latency-ms", "300") as base:
        yield base


def calls_per_task(base: str) -> Counter[str]:
    return Counter(str(e["idempotency_key"]) for e in mock_log(base))


async def submit_many(gw: Gateway, auth: dict[str, str], url: str, n: int,
                      **fields: Any) -> list[str]:
    return [(await gw.submit(auth, url, body=str(i), **fields))["task_id"] for i in range(n)]


async def leases_by_pid(gw: Gateway, endpoint: str) -> dict[int, list[str]]:
    """Who holds the claims of an endpoint: lease tokens start with `<pid>@<host>.`."""
    r, k = gw.rt.redis, gw.rt.keys
    held: dict[int, list[str]] = {}
    for tid in await r.zrange(k.active(endpoint), 0, -1):
        token = await r.hget(k.task(str(tid)), "lease")
        if token:
            held.setdefault(int(str(token).split("@")[0]), []).append(str(tid))
    return held


async def eventually(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_kill_9_with_calls_in_flight_loses_nothing(
    gateway: Gateway, slow_upstream: str, dispatcher_process: Spawn
) -> None:
    url = f"{slow_upstream}/k9"
    await gateway.add_endpoint("k9", url, max_concurrency=12, max_retries=2)
    auth = await gateway.new_key()
    ids = await submit_many(gateway, auth, url, 72)
    # 8 slots a process, 6 of them for one endpoint: neither takes the whole cap of 12, so
    # both hold calls when one dies, however the wake-ups fall between them.
    procs = {p.pid: p for p in (dispatcher_process(QGW_DISPATCH_CONCURRENCY="8"),
                                dispatcher_process(QGW_DISPATCH_CONCURRENCY="8"))}

    async def both_busy() -> bool:
        held = await leases_by_pid(gateway, "k9")
        return len(held) == 2 and min(map(len, held.values())) >= 3

    await eventually(both_busy, 15, "both dispatchers to hold claims")
    victim = max((await leases_by_pid(gateway, "k9")).items(), key=lambda kv: len(kv[1]))[0]
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait()
    orphans = (await leases_by_pid(gateway, "k9"))[victim]  # still leased to the dead process

    done = await gateway.wait_finished(auth, ids, timeout=30)
    assert {d["task_status"] for d in done} == {"completed"}
    stats = await gateway.rt.redis.hgetall(gateway.rt.keys.stats("k9"))
    assert int(stats["completed"]) == len(ids)  # each recorded once, though some ran twice
    calls = calls_per_task(slow_upstream)
    assert set(calls) == set(ids) and max(calls.values()) <= 3  # max_retries + 1
    by_id = {d["task_id"]: d for d in done}
    assert orphans and all(by_id[t]["attempts"] == 2 for t in orphans)  # run again
    assert all(calls[t] <= d["attempts"] for t, d in by_id.items())


async def test_sigterm_hands_calls_back_at_once_and_lets_short_ones_finish(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn
) -> None:
    url = f"{fresh_upstream}/term"
    await gateway.add_endpoint("term", url, max_concurrency=6)
    auth = await gateway.new_key()
    # Claimed first, in this order: 2 calls that end inside the grace period, 4 that do not;
    # then 6 that wait in the queue.
    short = [await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["600"]})
             for _ in range(2)]
    long = [await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["2000"]})
            for _ in range(4)]
    queued = await submit_many(gateway, auth, url, 6, headers={"X-Mock-Latency-Ms": ["100"]})
    lease_s = 60
    proc = dispatcher_process(QGW_LEASE_MS=str(lease_s * 1000), QGW_SHUTDOWN_GRACE_S="1.2")

    async def six_running() -> bool:
        return sum(map(len, (await leases_by_pid(gateway, "term")).values())) == 6

    await eventually(six_running, 15, "six calls in flight")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.wait, 10)
    stopped_s = time.monotonic() - sent
    assert proc.returncode == 0 and stopped_s < 3  # grace 1.2 s, then one release pipeline

    for t in short:  # finished inside the grace period and recorded, not handed back
        s = await gateway.status(auth, t["task_id"])
        assert (s["task_status"], s["attempts"]) == ("completed", 1)
    back = [await gateway.status(auth, t["task_id"]) for t in long]
    assert {s["task_status"] for s in back} == {"pending"}  # now, not after the 60 s lease
    assert [s["wait_num"] for s in back] == [0, 1, 2, 3]  # their old places, ahead of the rest
    assert await gateway.rt.redis.zcard(gateway.rt.keys.active("term")) == 0

    dispatcher_process()
    ids = [t["task_id"] for t in short + long] + queued
    done = await gateway.wait_finished(auth, ids, timeout=20)
    assert {d["task_status"] for d in done} == {"completed"}
    calls = calls_per_task(fresh_upstream)
    assert [calls[t["task_id"]] for t in long] == [2, 2, 2, 2]  # interrupted once, then run
    assert [d["attempts"] for d in done[2:6]] == [2, 2, 2, 2]


async def test_second_sigterm_cuts_the_grace_short(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn
) -> None:
    url = f"{fresh_upstream}/twice"
    await gateway.add_endpoint("twice", url)
    auth = await gateway.new_key()
    # Calls of 20 s, and a grace of 60: only a cut grace ends the process well within 10 s
    # (a bound that a loaded CI host's slow exit cannot reach, unlike one near the call time).
    ids = await submit_many(gateway, auth, url, 2, headers={"X-Mock-Latency-Ms": ["20000"]})
    proc = dispatcher_process(QGW_LEASE_MS="60000", QGW_SHUTDOWN_GRACE_S="60")

    async def both_running() -> bool:
        return sum(map(len, (await leases_by_pid(gateway, "twice")).values())) == 2

    await eventually(both_running, 15, "two calls in flight")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.wait, 15)
    assert proc.returncode == 0 and time.monotonic() - sent < 10
    assert {(await gateway.status(auth, t))["task_status"] for t in ids} == {"pending"}


async def test_runtime_stop_hands_calls_back(
    gateway: Gateway, fresh_upstream: str, settings: Settings
) -> None:
    """The path of `qgw serve`: uvicorn's lifespan calls Runtime.stop -> Dispatcher.stop."""
    url = f"{fresh_upstream}/rt"
    await gateway.add_endpoint("rt", url)
    auth = await gateway.new_key()
    ids = await submit_many(gateway, auth, url, 3, headers={"X-Mock-Latency-Ms": ["1500"]})
    rt = Runtime(settings.model_copy(update={"lease_ms": 60_000}), with_dispatcher=True)
    await rt.start()

    async def three_claimed() -> bool:
        return bool(await gateway.rt.redis.zcard(gateway.rt.keys.active("rt")) == 3)

    await eventually(three_claimed, 5, "three claims")
    started = time.monotonic()
    await rt.stop(grace_s=0.2)
    assert time.monotonic() - started < 1.5
    assert {(await gateway.status(auth, t))["task_status"] for t in ids} == {"pending"}


async def test_flaky_upstream_every_task_ends_with_its_attempts(
    gateway: Gateway, dispatcher_process: Spawn
) -> None:
    with mock_upstream("--fail-rate", "0.5") as base:
        url = f"{base}/flaky"
        await gateway.add_endpoint("flaky", url, max_retries=3, retry_backoff_ms=20)
        auth = await gateway.new_key()
        ids = await submit_many(gateway, auth, url, 40)
        dispatcher_process()
        done = await gateway.wait_finished(auth, ids, timeout=20)
        log = mock_log(base)
    calls = Counter(str(e["idempotency_key"]) for e in log)
    last = {str(e["idempotency_key"]): e["status"] for e in log}
    for d in done:
        tid = d["task_id"]
        assert d["task_status"] in ("completed", "failed")
        assert d["attempts"] == calls[tid] <= 4  # max_retries + 1, each attempt shown
        if d["task_status"] == "completed":
            assert (last[tid], d["result_status_code"]) == (200, 200)
        else:
            assert (d["attempts"], d["result_status_code"], last[tid]) == (4, 503, 503)
    assert any(d["attempts"] > 1 for d in done)  # half the calls fail: retries did happen


async def test_same_idempotency_key_makes_one_task(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn
) -> None:
    url = f"{fresh_upstream}/idem"
    await gateway.add_endpoint("idem", url)
    auth, other = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)

    async def post(key: dict[str, str]) -> str:
        r = await gateway.http.post("/api/v1/tasks", json={"target_url": url, "body": "x"},
                                    headers={**key, "Idempotency-Key": "order-42"})
        assert r.status_code == 202, r.text
        return str(r.json()["task_id"])

    first = await post(auth)
    again = await asyncio.gather(*(post(auth) for _ in range(5)))
    assert set(again) == {first}
    theirs = await post(other)  # the key is scoped to its user
    assert theirs != first
    assert await gateway.rt.redis.zcard(gateway.rt.keys.queue("idem")) == 2
    dispatcher_process()
    await gateway.wait_finished(auth, [first])
    assert calls_per_task(fresh_upstream)[first] == 1


@pytest.mark.usefixtures("own_redis")
class TestRedisOutage:
    """Against a Redis of their own, which these tests stop and start again."""

    @pytest.fixture
    def settings(self, own_redis: RedisServer, tmp_path: Path) -> Settings:
        """Overrides conftest's for this class: `gateway`, `env` and friends use it too."""
        return Settings(
            redis_url=own_redis.url, database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db",
            data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
            permit_secret="test-permit-secret", lease_ms=3000, reap_interval_ms=200,
        )

    async def test_api_answers_503_quickly_while_redis_is_down(
        self, gateway: Gateway, own_redis: RedisServer, fresh_upstream: str
    ) -> None:
        url = f"{fresh_upstream}/down"
        await gateway.add_endpoint("down", url)
        auth = await gateway.new_key()
        tid = (await gateway.submit(auth, url))["task_id"]
        own_redis.stop()
        for method, path, body in (("POST", "/api/v1/tasks", {"target_url": url}),
                                   ("GET", f"/api/v1/tasks/{tid}", None),
                                   ("GET", f"/api/v1/tasks/{tid}?wait=5", None)):
            started = time.monotonic()
            r = await gateway.http.request(method, path, json=body, headers=auth)
            took = time.monotonic() - started
            assert r.status_code == 503 and r.headers["retry-after"], (path, r.text)
            assert r.json()["error"]["code"] == "redis_unavailable"
            assert took < 1.2, f"{method} {path} took {took:.2f} s"
        assert (await gateway.http.get("/readyz")).status_code == 503
        assert (await gateway.http.get("/healthz")).status_code == 200
        scraped = await gateway.http.get("/metrics")  # this process's own, and that it is cut off
        assert scraped.status_code == 200 and "\nqgw_redis_up 0\n" in scraped.text
        assert "qgw_submit_latency_seconds" in scraped.text
        own_redis.start()  # same port, same append-only file
        await eventually(lambda: _answers(gateway), 5, "redis to load its data")
        assert (await gateway.status(auth, tid))["task_status"] == "pending"
        await gateway.submit(auth, url)

    async def test_redis_restart_mid_run_loses_nothing(
        self, gateway: Gateway, own_redis: RedisServer, dispatcher_process: Spawn
    ) -> None:
        """Down for longer than a lease (3 s): dispatchers back off, reconnect, renew their
        leases before anybody reaps them, and record every result: no call is made twice."""
        with mock_upstream("--latency-ms", "100") as base:
            url = f"{base}/restart"
            await gateway.add_endpoint("restart", url, max_concurrency=8)
            auth = await gateway.new_key()
            ids = await submit_many(gateway, auth, url, 96)
            dispatcher_process()
            dispatcher_process()
            await eventually(lambda: _at_least(base, 24), 15, "a quarter of the calls")
            own_redis.stop()
            await asyncio.sleep(4)
            own_redis.start()
            await eventually(lambda: _answers(gateway), 5, "redis to load its data")
            done = await gateway.wait_finished(auth, ids, timeout=30)
            calls = calls_per_task(base)
        assert {d["task_status"] for d in done} == {"completed"}
        assert set(calls) == set(ids) and set(calls.values()) == {1}

    async def test_submits_redis_stalled_on_retried_with_their_key_call_once(
        self, gateway: Gateway, own_redis: RedisServer, fresh_upstream: str,
        dispatcher_process: Spawn,
    ) -> None:
        """Redis paused (SIGSTOP) under 30 submits: those answered 503 may be queued anyway
        (Redis runs what it buffered once it resumes). The 503 says so; retried with the
        same Idempotency-Key, every key makes exactly one task and one upstream call."""
        url = f"{fresh_upstream}/stalled"
        await gateway.add_endpoint("stalled", url)
        auth = await gateway.new_key()
        dispatcher_process()

        async def post(i: int) -> httpx.Response:
            return await gateway.http.post(
                "/api/v1/tasks", json={"target_url": url, "body": str(i)},
                headers={**auth, "Idempotency-Key": f"order-{i}"})

        async def staggered() -> list[httpx.Response]:
            sent = []
            for i in range(30):
                sent.append(asyncio.create_task(post(i)))
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*sent))

        assert own_redis.proc is not None
        run = asyncio.create_task(staggered())
        await asyncio.sleep(0.5)
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(3)
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        answers = await run
        refused = [i for i, r in enumerate(answers) if r.status_code == 503]
        assert refused and {r.status_code for r in answers} == {202, 503}
        for i in refused:
            err = answers[i].json()["error"]
            assert err["code"] == "redis_unavailable" and answers[i].headers["retry-after"]
            assert "may have been queued" in err["message"], err
            assert "same Idempotency-Key" in err["message"], err
        ids = {i: str(r.json()["task_id"]) for i, r in enumerate(answers) if i not in refused}
        queued_anyway = 0
        for i in refused:
            again = await post(i)
            assert again.status_code == 202, again.text
            ids[i] = str(again.json()["task_id"])
            queued_anyway += ids[i] == answers[i].json()["error"]["task_id"]
        print(f"{len(refused)} of 30 answered 503; {queued_anyway} of them had been queued")
        assert queued_anyway > 0  # the 503 was no proof the task was not queued
        assert len(set(ids.values())) == 30
        await gateway.wait_finished(auth, list(ids.values()), timeout=30)
        calls = calls_per_task(fresh_upstream)
        assert set(calls) == set(ids.values()) and set(calls.values()) == {1}


async def _answers(gw: Gateway) -> bool:
    try:
        return bool(await gw.rt.redis.ping())
    except RedisError:  # refused, or still loading the append-only file
        return False


async def _at_least(base: str, n: int) -> bool:
    async with httpx.AsyncClient(verify=TLS) as http:
        return int((await http.get(f"{base}/_mock/stats")).json()["received"]) >= n


async def test_dispatcher_started_while_redis_is_down_waits_for_it(
    tmp_path: Path, settings: Settings
) -> None:
    """`qgw dispatcher` rides out a Redis that is not up yet instead of exiting."""
    server = RedisServer(tmp_path / "redis")
    env = {**os.environ, "QGW_REDIS_URL": server.url, "QGW_DATA_DIR": str(tmp_path),
           "QGW_DATABASE_URL": settings.db_url, "QGW_ADMIN_TOKEN": ADMIN}
    proc = subprocess.Popen([*QGW, "dispatcher"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        await asyncio.to_thread(read_until, proc, "cannot reach Redis")  # it waits
        assert proc.poll() is None
        server.start()
        await asyncio.to_thread(read_until, proc, "dispatcher running")
        assert proc.poll() is None
    finally:
        stop(proc)
        server.stop()
    assert proc.returncode == 0
