"""Chaos: thousands of tasks while dispatchers are killed with SIGKILL and Redis restarts once.

Starts its own Redis (the embedded binary, append-only file on), a mock upstream with latency,
the API in-process, and 3 `qgw dispatcher` processes.  While tasks are submitted it kills a
random dispatcher every few seconds (and starts a replacement) and restarts Redis once; then it
waits for every task to end and prints what happened to them, and how many upstream calls were
made twice (at-least-once delivery: a killed dispatcher's calls in flight run again).
Bounded to about a minute; loopback only.  Usage: python bench/chaos.py [--tasks N] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis.exceptions import RedisError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import migrate
from app.main import create_app
from app.runtime import Runtime
from app.settings import Settings
from tests.servers import QGW, RedisServer, mock_log, mock_upstream, stop

ADMIN = "chaos-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
EP = "chaos"
LEASE_MS, LATENCY_MS, CONCURRENCY = 3000, 200, 48
SUBMIT_S, KILL_EVERY_S, REDIS_RESTART_AT_S, REDIS_DOWN_S = 24.0, 3.0, 10.0, 4.0
DRAIN_DEADLINE_S = 58.0  # from the start of the load: give up waiting for tasks then


@dataclass
class Run:
    settings: Settings
    env: dict[str, str]
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kills: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, pid, active, held
    ids: dict[int, str] = field(default_factory=dict)  # submission number -> task id
    rejected: Counter[int] = field(default_factory=Counter)  # HTTP status -> count, retried
    redis_down: tuple[float, float] = (0.0, 0.0)

    def spawn(self) -> None:
        with open(self.logs / f"dispatcher-{len(self.procs)}.log", "wb") as out:
            self.procs.append(subprocess.Popen([*QGW, "dispatcher"], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=out))

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    async def wait_running(self, timeout: float = 20.0) -> None:
        """Until every dispatcher started so far has logged that it runs (imports are slow)."""
        deadline = time.monotonic() + timeout
        logs = [self.logs / f"dispatcher-{i}.log" for i in range(len(self.procs))]
        while not all(b"dispatcher running" in f.read_bytes() for f in logs):
            if time.monotonic() > deadline:
                raise TimeoutError("dispatchers did not start")
            await asyncio.sleep(0.1)


async def submit_all(run: Run, http: httpx.AsyncClient, auth: dict[str, str], url: str,
                     n: int, clients: int = 32) -> None:
    """n tasks spread over SUBMIT_S by `clients` callers; a 503 (Redis down) is retried after
    a jittered Retry-After with the same Idempotency-Key, so a submit whose answer was lost
    cannot make a second task."""
    start = time.monotonic()
    todo = iter(range(n))

    async def client() -> None:
        for i in todo:
            await asyncio.sleep(max(0.0, start + i * SUBMIT_S / n - time.monotonic()))
            headers = {**auth, "Idempotency-Key": f"chaos-{i}"}
            while True:
                try:
                    r = await http.post("/api/v1/tasks", headers=headers,
                                        json={"target_url": url, "body": str(i)})
                except httpx.HTTPError:
                    r = None
                if r is not None and r.status_code == 202:
                    run.ids[i] = r.json()["task_id"]
                    break
                run.rejected[r.status_code if r is not None else 0] += 1
                wait = float(r.headers.get("retry-after", 1)) if r is not None else 1.0
                await asyncio.sleep(wait * random.uniform(0.5, 1.0))

    await asyncio.gather(*(client() for _ in range(clients)))


async def chaos(run: Run, rt: Runtime, redis: RedisServer, rng: random.Random) -> None:
    """Every KILL_EVERY_S, SIGKILL a random dispatcher and start another; restart Redis once."""
    start = time.monotonic()
    next_kill, restarted = start + KILL_EVERY_S, False
    while time.monotonic() - start < SUBMIT_S:
        await asyncio.sleep(0.05)
        now = time.monotonic()
        if not restarted and now - start >= REDIS_RESTART_AT_S:
            restarted = True
            await asyncio.to_thread(redis.stop)  # SIGTERM: the append-only file is flushed
            await asyncio.sleep(REDIS_DOWN_S)
            await asyncio.to_thread(redis.start)
            run.redis_down = (now - start, time.monotonic() - now)
        if now >= next_kill:
            next_kill = now + KILL_EVERY_S
            victim = rng.choice(run.alive())
            active, held = await in_flight(rt, victim.pid)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            run.kills.append((now - start, victim.pid, active, held))
            run.spawn()


async def in_flight(rt: Runtime, pid: int) -> tuple[int, int]:
    """Claims of the endpoint, and those held by `pid` (lease tokens begin `<pid>@`)."""
    try:
        ids = await rt.redis.zrange(rt.keys.active(EP), 0, -1)
        async with rt.redis.pipeline(transaction=False) as pipe:
            for tid in ids:
                pipe.hget(rt.keys.task(tid), "lease")
            leases = await pipe.execute()
    except RedisError:
        return -1, -1
    return len(ids), sum(1 for t in leases if t and t.startswith(f"{pid}@"))


async def outcome(rt: Runtime, ids: list[str]) -> Counter[str]:
    async with rt.redis.pipeline(transaction=False) as pipe:
        for tid in ids:
            pipe.hget(rt.keys.task(tid), "status")
        statuses = await pipe.execute()
    return Counter(s or "vanished" for s in statuses)


async def wait_finished(rt: Runtime, ids: list[str], deadline: float) -> Counter[str]:
    while True:
        try:
            counts = await outcome(rt, ids)
        except RedisError:
            counts = Counter({"pending": 1})
        if counts["pending"] + counts["processing"] == 0 or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.25)


async def setup(http: httpx.AsyncClient, url: str) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": EP, "target_url": url, "max_concurrency": CONCURRENCY, "max_queue_len": 0,
        "max_retries": 3, "retry_backoff_ms": 100})
    r.raise_for_status()
    r = await http.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['key']}"}


def report(run: Run, n: int, counts: Counter[str], calls: Counter[str], took: float) -> None:
    ids = list(run.ids.values())
    lost = counts["pending"] + counts["processing"] + counts["vanished"] + (n - len(ids))
    dup = sum(c - 1 for c in calls.values() if c > 1)
    uncalled = sum(1 for t in ids if calls[t] == 0)
    print(f"3 dispatchers, lease {LEASE_MS} ms, upstream latency {LATENCY_MS} ms, "
          f"endpoint max_concurrency {CONCURRENCY}")
    print(f"chaos: {n} tasks over {SUBMIT_S:.0f} s, {len(run.kills)} SIGKILLs, "
          f"Redis down {run.redis_down[1]:.1f} s at t={run.redis_down[0]:.1f} s; "
          f"all ended {took:.1f} s after the first submit")
    print(f"  submitted             {len(ids)}  (503/errors retried with the same "
          f"Idempotency-Key: {sum(run.rejected.values())} {dict(run.rejected)})")
    print(f"  completed             {counts['completed']}")
    print(f"  failed                {counts['failed']}")
    unfinished = counts["pending"] + counts["processing"]
    print(f"  lost                  {lost}  (never finished {unfinished}, "
          f"vanished {counts['vanished']}, never accepted {n - len(ids)})")
    print(f"  duplicate calls       {dup}  (upstream calls per task beyond the first; "
          f"{sum(1 for c in calls.values() if c > 1)} tasks called twice or more, "
          f"max {max(calls.values(), default=0)}; tasks never called {uncalled})")
    in_flight = [held for *_, held in run.kills if held >= 0]
    print(f"  in flight at kills    {sum(in_flight)} held by the victims "
          f"(active ZSet size / victim's share at each kill:)")
    for t, pid, active, held in run.kills:
        print(f"    t={t:5.1f} s  pid {pid:<7d} active {active:3d}  held by victim {held:3d}")


async def main(n: int, seed: int) -> int:
    rng = random.Random(seed)
    logging.basicConfig(level=logging.ERROR)  # the in-process API warns on every 503
    with (tempfile.TemporaryDirectory(prefix="qgw-chaos-") as tmp,
          mock_upstream("--latency-ms", str(LATENCY_MS)) as upstream):
        root = Path(tmp)
        redis = RedisServer(root / "redis")
        redis.start()
        settings = Settings(redis_url=redis.url, database_url=f"sqlite+aiosqlite:///{root}/q.db",
                            data_dir=root, admin_token=ADMIN, key_prefix="chaos")
        await asyncio.to_thread(migrate.upgrade, settings.db_url)
        env = {**os.environ, "QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": settings.db_url,
               "QGW_DATA_DIR": tmp, "QGW_ADMIN_TOKEN": ADMIN, "QGW_KEY_PREFIX": "chaos",
               "QGW_LEASE_MS": str(LEASE_MS), "QGW_REAP_INTERVAL_MS": "250",
               "QGW_LOG_LEVEL": "info"}
        run = Run(settings, env, root)
        rt = Runtime(settings)
        await rt.start()
        try:
            return await load(run, rt, redis, rng, n, upstream)
        finally:
            for p in run.procs:
                stop(p)
            await rt.stop()
            redis.stop()


async def load(run: Run, rt: Runtime, redis: RedisServer, rng: random.Random, n: int,
               upstream: str) -> int:
    url = f"{upstream}/{EP}"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(rt, manage=False)),
                                 base_url="http://gateway", timeout=10) as http:
        auth = await setup(http, url)
        for _ in range(3):
            run.spawn()
        await run.wait_running()
        start = time.monotonic()
        await asyncio.gather(submit_all(run, http, auth, url, n), chaos(run, rt, redis, rng))
        counts = await wait_finished(rt, list(run.ids.values()), start + DRAIN_DEADLINE_S)
        took = time.monotonic() - start
    calls = Counter(str(e["idempotency_key"]) for e in
                    await asyncio.to_thread(mock_log, upstream) if e["path"] == f"/{EP}")
    report(run, n, counts, calls, took)
    lost = n - counts["completed"] - counts["failed"]
    return 1 if lost else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=4000)
    p.add_argument("--seed", type=int, default=int(time.time()))
    a = p.parse_args()
    print(f"seed {a.seed}", flush=True)
    sys.exit(asyncio.run(main(a.tasks, a.seed)))

