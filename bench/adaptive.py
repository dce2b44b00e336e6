"""Adaptive concurrency against static caps, behind an upstream whose capacity moves.

The upstream (this file run with --serve, its own process) takes CAPACITY[k] calls at once in
phase k (20, then 5, then 30; --phase-s each, 60 by default): a call answers after 200 ms while
the calls in flight, itself included, are within the capacity, after 200 ms x in flight /
capacity past it (they share what it has), and at once with 503 past twice the capacity.
Three endpoints, each with its own copy of that upstream, run at the same time through one
`qgw api` and one `qgw dispatcher` on a private Redis: `concurrency: "adaptive"` (1..60), and
static caps of 20 and of 5; a feeder keeps each one's line at least BACKLOG long throughout.
Reported per phase and endpoint, from the upstream's log:
  goodput   2xx answered in the phase / what the capacity allows (capacity / 200 ms x phase)
            (goal >= 0.9)
  refused   503 share of the calls the upstream got (goal <= 2%)
  p50 ms    median latency of its answers (goal <= 300, 1.5 x the unloaded 200 ms)
  cap       the adaptive endpoint's learnt limit, averaged over the phase (admin view)
Loopback only; bounded (the run ends after its three phases).
Run: .venv/bin/python bench/adaptive.py [--phase-s 60] [--trace]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.runtime import Runtime
from app.settings import Settings
from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "adaptive-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
CAPACITY = (20, 5, 30)
LATENCY_S = 0.2
BACKLOG = 300
CONFIGS = {"adaptive": {"concurrency": "adaptive", "min_concurrency": 1, "max_concurrency": 60},
           "static-20": {"max_concurrency": 20}, "static-5": {"max_concurrency": 5}}


# -- the upstream ----------------------------------------------------------------------------

class MovingCapacity:
    def __init__(self, phase_s: float) -> None:
        self.phase_s, self.start = phase_s, 0.0
        self.in_flight: Counter[str] = Counter()
        self.log: dict[str, list[tuple[float, int, float]]] = {}  # (since start, status, s)

    def capacity(self, now: float) -> int:
        return CAPACITY[min(len(CAPACITY) - 1, int((now - self.start) // self.phase_s))]

    async def begin(self, request: web.Request) -> web.Response:
        self.start = time.monotonic()
        return web.json_response({"ok": True})

    async def serve(self, request: web.Request) -> web.Response:
        case, now = request.match_info["case"], time.monotonic()
        cap = self.capacity(now)
        self.in_flight[case] += 1
        try:
            n = self.in_flight[case]
            status, wait = (503, 0.0) if n > 2 * cap else (200, LATENCY_S * max(1.0, n / cap))
            await asyncio.sleep(wait)
            self.log.setdefault(case, []).append((now - self.start, status, wait))
            return web.json_response({"ok": status == 200}, status=status)
        finally:
            self.in_flight[case] -= 1

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.log.get(request.match_info["case"], []))


def serve(port: int, phase_s: float) -> None:
    up = MovingCapacity(phase_s)
    app = web.Application()
    app.router.add_post("/_start", up.begin)
    app.router.add_get("/_log/{case}", up.stats)
    app.router.add_post("/{case}", up.serve)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the run ---------------------------------------------------------------------------------

async def feed(rt: Runtime, url: str, case: str, until: float) -> None:
    """Keep the endpoint's line at least BACKLOG long until `until` (monotonic). Submitted
    in this process, through the queue the API uses (its HTTP round trip would be most of
    the cost: on a loaded machine it could not keep three lines full)."""
    from app.models import SubmitRequest
    from app.store import ApiKey

    key, req = ApiKey("bench", 1, "standard", 0, 0), SubmitRequest(target_url=url, body="{}")

    async def submit(n: int) -> None:
        endpoint = rt.registry.get(case)
        assert endpoint is not None
        for _ in range(n):
            await rt.queue.submit(key, endpoint, req, None)

    while True:
        missing = BACKLOG - await rt.redis.zcard(rt.keys.queue(case))
        if missing > 0:
            await asyncio.gather(*(submit(missing // 8 + 1) for _ in range(8)))
        elif time.monotonic() >= until:
            return
        else:
            await asyncio.sleep(0.1)


async def watch_cap(http: httpx.AsyncClient, start: float, until: float, phase_s: float
                    ) -> dict[int, list[int]]:
    admin, caps = {"Authorization": f"Bearer {ADMIN}"}, {}
    while (now := time.monotonic()) < until:
        rows = (await http.get("/admin/v1/queues", headers=admin)).json()["endpoints"]
        cap = next(q["adaptive_limit"] for q in rows if q["id"] == "adaptive")
        caps.setdefault(min(len(CAPACITY) - 1, int((now - start) // phase_s)), []).append(cap)
        await asyncio.sleep(1)
    return caps


def report(logs: dict[str, list[list[float]]], caps: dict[int, list[int]], phase_s: float,
           trace: bool = False) -> None:
    print(f"phases of {phase_s:g} s, upstream capacity {' -> '.join(map(str, CAPACITY))}; goals: "
          "goodput >= 0.9, refused <= 2%, p50 <= 300 ms")
    print(f"{'phase':>5} {'cap':>4} {'endpoint':>10} {'calls':>6} {'2xx':>6} {'goodput':>8} "
          f"{'refused':>8} {'p50 ms':>7} {'learnt':>7}")
    for k, capacity in enumerate(CAPACITY):
        for case in CONFIGS:
            rows = [r for r in logs[case] if k * phase_s <= r[0] < (k + 1) * phase_s]
            ok = [r[2] for r in rows if r[1] == 200]
            goodput = len(ok) / (capacity / LATENCY_S * phase_s)
            refused = sum(1 for r in rows if r[1] == 503) / len(rows) if rows else float("nan")
            p50 = statistics.median(ok) * 1000 if ok else float("nan")
            learnt = f"{statistics.mean(caps[k]):.1f}" if case == "adaptive" and caps.get(k) \
                else "-"
            print(f"{k + 1:>5} {capacity:>4} {case:>10} {len(rows):>6} {len(ok):>6} "
                  f"{goodput:>8.2f} {refused:>8.1%} {p50:>7.0f} {learnt:>7}")
    if trace:  # the learnt cap second by second: how fast it finds each capacity
        for k, seen in sorted(caps.items()):
            print(f"phase {k + 1} learnt cap each second: {' '.join(map(str, seen))}")


async def main(phase_s: float, trace: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-adaptive-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    up_port, api_port = free_port(), free_port()
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "error",
           "QGW_KEY_PREFIX": "adaptive"}
    procs = [spawn([sys.executable, __file__, "--serve", str(up_port), "--phase-s",
                    str(phase_s)]), spawn([*QGW, "api", "--port", str(api_port)], env)]
    upstream, admin = f"http://127.0.0.1:{up_port}", {"Authorization": f"Bearer {ADMIN}"}
    try:
        for port, proc in zip((up_port, api_port), procs, strict=True):
            wait_port(port, 30, proc)
        procs.append(spawn([*QGW, "dispatcher"], env))
        rt = Runtime(Settings(redis_url=redis.url, database_url=env["QGW_DATABASE_URL"],
                              data_dir=tmp, key_prefix="adaptive", admin_token=ADMIN))
        await rt.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=30,
                                     limits=httpx.Limits(max_connections=64)) as http:
            for case, fields in CONFIGS.items():
                (await http.post("/admin/v1/endpoints", headers=admin, json={
                    "id": case, "target_url": f"{upstream}/{case}", "max_queue_len": 0,
                    "max_retries": 20, "retry_backoff_ms": 200, "paused": True,
                    **fields})).raise_for_status()
            await asyncio.sleep(1.2)  # every process has seen the endpoints
            await asyncio.gather(*(feed(rt, f"{upstream}/{c}", c, 0) for c in CONFIGS))
            (await http.post(f"{upstream}/_start")).raise_for_status()
            start = time.monotonic()
            until = start + phase_s * len(CAPACITY)
            for case in CONFIGS:
                (await http.patch(f"/admin/v1/endpoints/{case}", headers=admin,
                                  json={"paused": False})).raise_for_status()
            *_, caps = await asyncio.gather(
                *(feed(rt, f"{upstream}/{c}", c, until) for c in CONFIGS),
                watch_cap(http, start, until, phase_s))
            for case in CONFIGS:
                (await http.patch(f"/admin/v1/endpoints/{case}", headers=admin,
                                  json={"paused": True})).raise_for_status()
            logs = {c: (await http.get(f"{upstream}/_log/{c}")).json() for c in CONFIGS}
        await rt.stop()
        report(logs, caps, phase_s, trace)
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--trace", action="store_true",
                        help="also print the learnt cap second by second")
    parser.add_argument("--serve", type=int, metavar="PORT", help="run the upstream only")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.phase_s)
    else:
        asyncio.run(main(args.phase_s, args.trace))
