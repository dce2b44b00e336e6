"""Submit and dispatch throughput, as ratios to baselines measured in the same run.

(a) submit over HTTP, one uvicorn worker (`qgw api`), against a trivial FastAPI route making one
    Redis call (bench/baseline_app.py); the two are measured alternately, three rounds each.
(b) no-op dispatch: tasks per second from submit to completed, one `qgw dispatcher`, the mock
    upstream at latency 0; beside it, the same number of calls made straight to the mock with
    the gateway's own upstream client from one process, 64 at a time (what calling the mock
    alone costs here).
Loopback only; bounded to about a minute.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import build_request, hammer, spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "bench-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
ROUNDS, SECONDS, TASKS = 3, 4.0, 3000


async def setup_gateway(
    port: int, upstream: str, endpoints: Sequence[str] = ("submit", "noop")
) -> dict[str, str]:
    """Register `endpoints` (each at `<upstream>/<id>`, unbounded queue) and one user's key."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for ep in endpoints:
            r = await http.post("/admin/v1/endpoints", headers=admin, json={
                "id": ep, "target_url": f"{upstream}/{ep}", "max_queue_len": 0})
            r.raise_for_status()
        r = await http.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})
        return {"Authorization": f"Bearer {r.json()['key']}"}


async def completed(redis_url: str, prefix: str, endpoint: str) -> int:
    from redis.asyncio import Redis

    async with Redis.from_url(redis_url) as r:
        return int(await r.hget(f"{prefix}:{{{endpoint}}}:stats", "completed") or 0)


async def until_completed(redis_url: str, n: int, within_s: float = 60) -> None:
    """Until `n` no-op tasks have completed; a run that takes longer has failed."""
    started = time.monotonic()
    while (done := await completed(redis_url, "bench", "noop")) < n:
        if time.monotonic() - started > within_s:
            raise SystemExit(f"only {done} of {n} completed in {within_s:.0f} s")
        await asyncio.sleep(0.02)


async def direct_calls(upstream: str, n: int, concurrency: int = 64) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem, http.post(f"{upstream}/direct", data=str(i)) as resp:
                resp.raise_for_status()
                await resp.read()

        start = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.monotonic() - start)


async def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-bench-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    mock_port, api_port, base_port = free_port(), free_port(), free_port()
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning",
           "QGW_KEY_PREFIX": "bench"}
    procs = [spawn([*QGW, "mock-upstream", "--port", str(mock_port)]),
             spawn([*QGW, "api", "--port", str(api_port)], env),
             spawn([sys.executable, "bench/baseline_app.py", str(base_port), redis.url])]
    try:
        for port, proc in zip((mock_port, api_port, base_port), procs, strict=True):
            wait_port(port, 30, proc)
        upstream = f"http://127.0.0.1:{mock_port}"
        auth = await setup_gateway(api_port, upstream)

        body = {"target_url": f"{upstream}/submit", "http_method": "POST", "body": "{}",
                "priority": 0, "task_type": "offline"}
        ours, base = [], []
        for _ in range(ROUNDS):
            base.append(await hammer(base_port, build_request("POST", "/api/v1/tasks", {}, body),
                                     seconds=SECONDS))
            ours.append(await hammer(api_port, build_request("POST", "/api/v1/tasks", auth, body),
                                     seconds=SECONDS))
        assert all(set(r.statuses) == {202} for r in ours + base), [r.statuses for r in ours]
        q, b = statistics.median(r.rps for r in ours), statistics.median(r.rps for r in base)
        print(f"(a) submit: {q:.0f} req/s vs baseline {b:.0f} req/s  ->  ratio {q / b:.2f}")

        # (a) left tens of thousands of tasks queued for `submit`: (b) measures a dispatcher
        # with nothing else to do, so their number (which grows with (a)'s speed) is not in it.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}") as http:
            purged = await http.post("/admin/v1/endpoints/submit/purge",
                                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
            purged.raise_for_status()
        disp = spawn([*QGW, "dispatcher"], env)
        procs.append(disp)
        noop = build_request("POST", "/api/v1/tasks", auth, {**body, "target_url":
                                                                f"{upstream}/noop"})
        # Timed from a dispatcher already at work: not its start-up (imports, first claims).
        await hammer(api_port, noop, count=1)
        await until_completed(redis.url, 1)
        start = time.monotonic()
        await hammer(api_port, noop, count=TASKS)
        await until_completed(redis.url, 1 + TASKS)
        dispatch = TASKS / (time.monotonic() - start)
        direct = await direct_calls(upstream, TASKS)
        print(f"(b) dispatch: {dispatch:.0f} tasks/s submit->completed (submits over HTTP "
              f"meanwhile) vs {direct:.0f} direct calls/s to the mock from one process  ->  "
              f"ratio {dispatch / direct:.2f}")
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


if __name__ == "__main__":
    asyncio.run(main())
