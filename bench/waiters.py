"""What waiting callers cost Redis: 300 `?wait=` long-polls, idle and under load.

Starts its own Redis, the mock upstream, `qgw api` and `qgw dispatcher`.  The waiters' tasks
sit in a queue nobody will claim for an hour (rate 1 an hour, its one admission spent), so
their status never changes: every command a waiter causes is overhead.  Each waiter loops
`GET /api/v1/tasks/{id}?wait=30`.  Redis commands/s come from the `INFO commandstats` delta
over a window, with and without the waiters:
- idle: nothing else happens;
- under load: a steady stream of submits to a second endpoint that the dispatcher runs.
A last figure: the latency from a task's completion to its waiter's answer (event or poll).
Loopback only, about a minute.  Usage: python bench/waiters.py [--waiters N] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.mock_upstream import CONTROL_HEADERS
from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "waiters-admin-token-01"  # QGW_ADMIN_TOKEN: 16 characters at least
LOAD_PER_S = 100  # submits a second to the busy endpoint
LATENCY_MS = 20
VERBOSE = "-v" in sys.argv  # which commands
SETTLE_S = 3.0


def commands(r: redis.Redis) -> Counter[str]:
    """Commands Redis has served, by name (INFO commandstats)."""
    stats = r.info("commandstats")
    return Counter({k: int(v["calls"]) for k, v in stats.items()})  # type: ignore[index]


def rate(r: redis.Redis, seconds: float) -> float:
    before, start = commands(r), time.monotonic()
    time.sleep(seconds)
    delta = commands(r) - before
    if VERBOSE:
        print("   ", delta.most_common(6))
    return (delta.total() - 1) / (time.monotonic() - start)  # minus our INFO


async def waiter(http: httpx.AsyncClient, auth: dict[str, str], task_id: str,
                 stop_at: float) -> None:
    while time.monotonic() < stop_at:
        try:
            r = await http.get(f"/api/v1/tasks/{task_id}", params={"wait": 30}, headers=auth)
        except httpx.TransportError:  # a pooled connection the server had just closed
            continue
        r.raise_for_status()


async def load(http: httpx.AsyncClient, auth: dict[str, str], url: str, stop_at: float) -> None:
    """LOAD_PER_S submits a second, paced, until stop_at."""
    n, start = 0, time.monotonic()
    while time.monotonic() < stop_at:
        n += 1
        r = await http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
        r.raise_for_status()
        await asyncio.sleep(max(0.0, start + n / LOAD_PER_S - time.monotonic()))


async def measure(r: redis.Redis, seconds: float) -> float:
    await asyncio.sleep(SETTLE_S)  # past the waiters' first reads, and the load's ramp
    return await asyncio.to_thread(rate, r, seconds)


async def wake_latency(http: httpx.AsyncClient, auth: dict[str, str], url: str) -> list[float]:
    """Seconds from a task's ended_at (Redis clock) to its waiter's answer, for 20 tasks."""
    out = []
    for _ in range(20):
        task = (await http.post("/api/v1/tasks", headers=auth, json={
            "target_url": url, "headers": {"X-Mock-Latency-Ms": ["300"]}})).json()
        while True:
            s = (await http.get(f"/api/v1/tasks/{task['task_id']}", params={"wait": 30},
                                headers=auth)).json()
            if s["task_status"] not in ("pending", "processing"):
                break
        answered = time.time()
        out.append(answered - datetime.fromisoformat(s["ended_at"]).timestamp())
    return out


async def run(http: httpx.AsyncClient, r: redis.Redis, upstream: str, waiters: int,
              seconds: float) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    key = (await http.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})).json()
    auth = {"Authorization": f"Bearer {key['key']}"}
    for eid, fields in (("parked", {"rate": 1, "interval_ms": 3_600_000}),
                        ("busy", {"max_concurrency": 32})):
        (await http.post("/admin/v1/endpoints", headers=admin, json={
            "id": eid, "target_url": f"{upstream}/{eid}",
            "forward_headers": list(CONTROL_HEADERS), **fields})).raise_for_status()
    await asyncio.sleep(1.5)  # every process sees new endpoints within a second
    parked, busy = f"{upstream}/parked", f"{upstream}/busy"
    ids = [(await http.post("/api/v1/tasks", headers=auth, json={"target_url": parked})
            ).json()["task_id"] for _ in range(waiters + 1)]
    ids = ids[1:]  # the first one used the hour's admission
    await asyncio.sleep(1.0)

    idle = await measure(r, seconds)
    stop_at = time.monotonic() + seconds + SETTLE_S + 0.5
    tasks = [asyncio.create_task(waiter(http, auth, t, stop_at)) for t in ids]
    idle_w = await measure(r, seconds)
    await asyncio.gather(*tasks)

    stop_at = time.monotonic() + 2 * (seconds + SETTLE_S) + 1
    loader = asyncio.create_task(load(http, auth, busy, stop_at))
    busy_0 = await measure(r, seconds)
    tasks = [asyncio.create_task(waiter(http, auth, t, stop_at)) for t in ids]
    busy_w = await measure(r, seconds)
    await asyncio.gather(loader, *tasks)

    lat = sorted(await wake_latency(http, auth, busy))
    print(f"{waiters} waiters (GET ?wait=30 in a loop on tasks that do not change), "
          f"Redis commands/s over {seconds:.0f} s:")
    print(f"  idle:       {idle:8.0f} without waiters, {idle_w:8.0f} with "
          f"(+{idle_w - idle:.0f}/s)")
    print(f"  under load: {busy_0:8.0f} without waiters, {busy_w:8.0f} with "
          f"(+{busy_w - busy_0:.0f}/s; load {LOAD_PER_S} tasks/s)")
    print(f"  completion -> waiter answered: median {statistics.median(lat) * 1000:.0f} ms, "
          f"max {lat[-1] * 1000:.0f} ms (20 tasks)")


async def main(waiters: int, seconds: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-waiters-"))
    server = RedisServer(tmp / "redis")
    server.start()
    mock_port, api_port = free_port(), free_port()
    env = {"QGW_REDIS_URL": server.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning",
           "QGW_KEY_PREFIX": "waiters"}
    procs = [spawn([*QGW, "mock-upstream", "--port", str(mock_port), "--latency-ms",
                    str(LATENCY_MS)]),
             spawn([*QGW, "api", "--port", str(api_port)], env)]
    try:
        for port, proc in zip((mock_port, api_port), procs, strict=True):
            wait_port(port, 30, proc)
        procs.append(spawn([*QGW, "dispatcher"], env))
        limits = httpx.Limits(max_connections=waiters + 32)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", limits=limits,
                                     timeout=60) as http:
            await run(http, redis.Redis(port=server.port), f"http://127.0.0.1:{mock_port}",
                      waiters, seconds)
    finally:
        for proc in procs:
            stop(proc)
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiters", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("-v", action="store_true", help="print the commands counted")
    args = parser.parse_args()
    asyncio.run(main(args.waiters, args.seconds))
