"""Outbox drain: how long finished tasks take to reach SQL once it comes back from an outage.

Starts its own Redis, a mock upstream, the API in-process and one `qgw dispatcher` process
(whose outbox writer does the work) on a SQLite file. Per phase: SQLite is held in
`BEGIN EXCLUSIVE` (the outage), N tasks run and finish meanwhile, the lock is released when
the outage ends, and the clock runs until every row is in SQL; then each task's status is read
(200 expected, never 404). The baseline phase does this with small results, the measured one
with 2 MB results, in the same run; the done TTL is a third of the outage, so the outage
outlasts it. Bounded (each drain gives up after --deadline-s); loopback only.
Usage: python bench/outbox_drain.py [--tasks 400] [--bytes 2000000] [--outage-s 90]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import migrate
from app.main import create_app
from app.mock_upstream import CONTROL_HEADERS
from app.runtime import Runtime
from app.settings import Settings
from tests.servers import QGW, RedisServer, mock_upstream, stop

ADMIN = "drain-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
SMALL_BYTES = 100


@dataclass
class Phase:
    name: str
    size: int
    finished_s: float = 0.0  # from the outage's start until the last task finished
    drained_s: float = float("nan")  # from the lock's release until the last row committed
    rows: int = 0
    statuses: Counter[str] | None = None


async def setup(http: httpx.AsyncClient, upstream: str, ep: str) -> dict[str, str]:
    """An endpoint and a key to call it with."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await http.post("/admin/v1/endpoints", headers=admin,
                        json={"id": ep, "target_url": f"{upstream}/{ep}",
                              "max_concurrency": 32, "timeout_ms": 60_000,
                              # X-Mock-Body-Bytes must reach the mock (an allow-list)
                              "forward_headers": list(CONTROL_HEADERS)})
    assert r.status_code == 201, r.text
    r = await http.post("/admin/v1/api-keys", headers=admin,
                        json={"user_id": 7, "max_priority": 0})
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def warm_up(http: httpx.AsyncClient, rt: Runtime, upstream: str) -> None:
    """One task through the dispatcher process: it has started (and migrated) before the
    outage begins."""
    auth = await setup(http, upstream, "warm")
    r = await http.post("/api/v1/tasks", headers=auth, json={"target_url": f"{upstream}/warm"})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while await rt.redis.hget(rt.keys.stats("warm"), "completed") != "1":
        assert time.monotonic() < deadline, "the dispatcher did not start"
        await asyncio.sleep(0.1)


async def run_phase(http: httpx.AsyncClient, rt: Runtime, db: Path, upstream: str,
                    phase: Phase, n: int, outage_s: float, deadline_s: float) -> Phase:
    ep = phase.name
    auth = await setup(http, upstream, ep)
    lock = sqlite3.connect(db, timeout=5, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    began = time.monotonic()
    try:
        ids = []
        for _ in range(n):
            r = await http.post("/api/v1/tasks", headers=auth, json={
                "target_url": f"{upstream}/{ep}",
                "headers": {"X-Mock-Body-Bytes": [str(phase.size)]}})
            assert r.status_code == 202, r.text
            ids.append(r.json()["task_id"])
        while await rt.redis.hget(rt.keys.stats(ep), "completed") != str(n):
            assert time.monotonic() - began < deadline_s, "tasks did not finish in time"
            await asyncio.sleep(0.2)
        phase.finished_s = time.monotonic() - began
        await asyncio.sleep(max(0.0, began + outage_s - time.monotonic()))
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    released = time.monotonic()
    while time.monotonic() - released < deadline_s:
        phase.rows = await asyncio.to_thread(_count, db, ep)
        if phase.rows == n:
            phase.drained_s = time.monotonic() - released
            break
        await asyncio.sleep(0.1)
    phase.statuses = Counter()
    for tid in ids:  # reads deliver the tasks: only once the drain is measured
        r = await http.get(f"/api/v1/tasks/{tid}", headers=auth)
        ok = r.status_code == 200 and len(r.json()["task_result"] or "") == phase.size
        phase.statuses[str(r.status_code) if ok or r.status_code != 200 else "200 short"] += 1
    return phase


def _count(db: Path, endpoint: str) -> int:
    with sqlite3.connect(db, timeout=5) as conn:
        got = conn.execute("SELECT count(*) FROM task_results WHERE endpoint = ?",
                           (endpoint,)).fetchone()
    return int(got[0])


def report(n: int, outage_s: float, small: Phase, large: Phase) -> None:
    print(f"{n} tasks a phase, SQLite held in BEGIN EXCLUSIVE for {outage_s:g} s "
          f"(done TTL {max(1, int(outage_s // 3))} s)")
    for p in (small, large):
        mb = n * p.size / 1e6
        rate = f"{mb / p.drained_s:.0f} MB/s" if p.drained_s == p.drained_s else "-"
        print(f"  {p.name:>8}: {n} x {p.size:,} B finished {p.finished_s:.1f} s into the outage;"
              f" {p.rows}/{n} rows in SQL {p.drained_s:.1f} s after it ({rate});"
              f" statuses {dict(p.statuses or {})}")
    print(f"  drain time, {large.size:,} B against {small.size} B results: "
          f"{large.drained_s / small.drained_s:.2f}x")


async def main(n: int, size: int, outage_s: float, deadline_s: float) -> int:
    logging.basicConfig(level=logging.ERROR)
    with (tempfile.TemporaryDirectory(prefix="qgw-drain-") as tmp, mock_upstream() as upstream):
        root = Path(tmp)
        redis = RedisServer(root / "redis")
        redis.start()
        db = root / "q.db"
        settings = Settings(redis_url=redis.url, database_url=f"sqlite+aiosqlite:///{db}",
                            data_dir=root, admin_token=ADMIN, key_prefix="drain",
                            done_ttl_s=max(1, int(outage_s // 3)))
        await asyncio.to_thread(migrate.upgrade, settings.db_url)
        env = {**os.environ, "QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": settings.db_url,
               "QGW_DATA_DIR": tmp, "QGW_ADMIN_TOKEN": ADMIN, "QGW_KEY_PREFIX": "drain",
               "QGW_DONE_TTL_S": str(settings.done_ttl_s)}
        with open(root / "dispatcher.log", "wb") as log:
            proc = subprocess.Popen([*QGW, "dispatcher"], env=env, stderr=log, stdout=log)
        rt = Runtime(settings)
        await rt.start()
        try:
            app = create_app(rt, manage=False)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://gateway", timeout=30) as http:
                await warm_up(http, rt, upstream)
                small = await run_phase(http, rt, db, upstream, Phase("small", SMALL_BYTES), n,
                                        outage_s, deadline_s)
                large = await run_phase(http, rt, db, upstream, Phase("large", size), n,
                                        outage_s, deadline_s)
        finally:
            stop(proc)
            await rt.stop()
            redis.stop()
    report(n, outage_s, small, large)
    lost = [p for p in (small, large) if p.rows != n or set(p.statuses or {}) != {"200"}]
    return 1 if lost else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--bytes", type=int, default=2_000_000, help="size of a large result")
    p.add_argument("--outage-s", type=float, default=90.0)
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="give up on a phase's tasks finishing, or its drain, after this")
    a = p.parse_args()
    sys.exit(asyncio.run(main(a.tasks, a.bytes, a.outage_s, a.deadline_s)))
