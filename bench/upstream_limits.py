"""An upstream with a hidden limit of its own behind a faster endpoint: honouring its signals.

The upstream (this file run with --serve, its own process) admits HIDDEN calls per fixed 1 s
window (aligned to the wall clock) and answers the rest 429 with `Retry-After`; every answer
carries `x-ratelimit-remaining-requests` and `x-ratelimit-reset-requests`, in one of two styles:
  s    the reset in whole seconds, rounded up (`1s`), as `Retry-After` must be
  ms   the reset to the millisecond (`250ms`, as OpenAI sends it); `Retry-After` still whole
  429  no `x-ratelimit-*` headers at all: only the 429's `Retry-After` tells
The endpoint in front of it is configured at 100 calls/s (sliding window, its default retries),
the upstream answers at once (latency 0).  A backlog of --tasks tasks is submitted to a paused
endpoint and released at once, drained by `qgw api` + one `qgw dispatcher` on a private Redis,
with `honor_upstream_limits` true (each style) and false, in the same run.  Reported:
  goodput  2xx per window over the steady part (every window between the first and the last
           one that served any call, both excluded: the backlog starts and ends inside them) /
           HIDDEN: 1.00 is the whole hidden limit used (target >= 0.95)
  429      share of the calls the upstream received that it answered 429 (target <= 1% when
           the x-ratelimit-* counts are sent)
  failed   tasks that ran out of retries (every 429 was a wasted attempt)
Loopback only; bounded (each run is cut off after RUN_LIMIT_S).
Run: .venv/bin/python bench/upstream_limits.py [--tasks 400]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "limits-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
HIDDEN = 20  # the upstream's own limit, per 1 s window
ENDPOINT_RATE = 100  # what the endpoint is configured for
RUN_LIMIT_S = 90.0
SUBMITTERS = 16


# -- the upstream ----------------------------------------------------------------------------

class HiddenLimit:
    """A fixed-window limit per case (the first path segment), recording every answer."""

    def __init__(self) -> None:
        self.used: dict[tuple[str, int], int] = Counter()
        self.log: dict[str, list[tuple[float, int]]] = {}

    async def serve(self, request: web.Request) -> web.Response:
        case, style = request.match_info["case"], request.match_info["style"]
        now = time.time()
        window = math.floor(now)
        reset = window + 1 - now  # seconds to the next window
        used = self.used[case, window] = self.used[case, window] + 1
        status = 200 if used <= HIDDEN else 429
        self.log.setdefault(case, []).append((now, status))
        reset_text = f"{math.ceil(reset * 1000)}ms" if style == "ms" else f"{math.ceil(reset)}s"
        headers = {} if style == "429" else {
            "x-ratelimit-limit-requests": str(HIDDEN),
            "x-ratelimit-remaining-requests": str(max(0, HIDDEN - used)),
            "x-ratelimit-reset-requests": reset_text}
        if status == 429:
            headers["Retry-After"] = str(max(1, math.ceil(reset)))
        return web.json_response({"ok": status == 200}, status=status, headers=headers)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.log.get(request.match_info["case"], []))


def serve(port: int) -> None:
    limit = HiddenLimit()
    app = web.Application()
    app.router.add_get("/_log/{case}", limit.stats)
    app.router.add_post("/{style}/{case}", limit.serve)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the runs --------------------------------------------------------------------------------

@dataclass
class Row:
    case: str
    honor: bool
    style: str
    calls: int
    ok: int
    too_many: int
    goodput: float
    failed: int
    seconds: float


def measure(case: str, honor: bool, style: str, log: list[tuple[float, int]], failed: int,
            seconds: float) -> Row:
    per_window = Counter(math.floor(t) for t, s in log if s == 200)
    windows = sorted({math.floor(t) for t, _ in log})
    inner = range(windows[0] + 1, windows[-1]) if windows else range(0)
    goodput = sum(per_window[w] for w in inner) / len(inner) / HIDDEN if inner else float("nan")
    ok = sum(1 for _, s in log if s == 200)
    too_many = sum(1 for _, s in log if s == 429)
    return Row(case, honor, style, len(log), ok, too_many, goodput, failed, seconds)


async def run_case(http: httpx.AsyncClient, auth: dict[str, str], redis_url: str,
                   upstream: str, honor: bool, style: str, tasks: int) -> Row:
    from redis.asyncio import Redis

    case = f"{'on' if honor else 'off'}-{style}"
    url = f"{upstream}/{style}/{case}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    (await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": case, "target_url": url, "rate": ENDPOINT_RATE, "interval_ms": 1000,
        "max_queue_len": 0, "honor_upstream_limits": honor, "paused": True,
    })).raise_for_status()
    sem = asyncio.Semaphore(SUBMITTERS)

    async def submit() -> None:
        async with sem:
            (await http.post("/api/v1/tasks", headers=auth, json={
                "target_url": url, "http_method": "POST", "body": "{}"})).raise_for_status()

    await asyncio.gather(*(submit() for _ in range(tasks)))
    await asyncio.sleep(1.2)  # the dispatcher has seen the new endpoint (within a second)
    start = time.monotonic()
    (await http.patch(f"/admin/v1/endpoints/{case}", headers=admin,
                      json={"paused": False})).raise_for_status()
    async with Redis.from_url(redis_url, decode_responses=True) as r:
        while time.monotonic() - start < RUN_LIMIT_S:
            done, failed = await r.hmget(f"limits:{{{case}}}:stats", "completed", "failed")
            if int(done or 0) + int(failed or 0) >= tasks:
                break
            await asyncio.sleep(0.2)
    seconds = time.monotonic() - start
    (await http.patch(f"/admin/v1/endpoints/{case}", headers=admin,
                      json={"paused": True})).raise_for_status()  # a cut-off run stops here
    log = [(float(t), int(s)) for t, s in (await http.get(f"{upstream}/_log/{case}")).json()]
    return measure(case, honor, style, log, int(failed or 0), seconds)


def report(rows: list[Row], tasks: int) -> None:
    print(f"{tasks} tasks per run; upstream limit {HIDDEN}/s (fixed 1 s windows), endpoint "
          f"{ENDPOINT_RATE}/s; goodput = 2xx per steady window / {HIDDEN}")
    print(f"{'honor':>6} {'reset':>6} {'calls':>6} {'2xx':>5} {'429':>5} {'429 share':>9} "
          f"{'goodput':>8} {'failed':>6} {'drained s':>9}")
    for r in rows:
        share = r.too_many / r.calls if r.calls else float("nan")
        print(f"{str(r.honor).lower():>6} {r.style:>6} {r.calls:>6} {r.ok:>5} {r.too_many:>5} "
              f"{share:>9.1%} {r.goodput:>8.2f} {r.failed:>6} {r.seconds:>9.1f}")


async def main(tasks: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-limits-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    up_port, api_port = free_port(), free_port()
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "error",
           "QGW_KEY_PREFIX": "limits"}
    procs = [spawn([sys.executable, __file__, "--serve", str(up_port)]),
             spawn([*QGW, "api", "--port", str(api_port)], env)]
    try:
        for port, proc in zip((up_port, api_port), procs, strict=True):
            wait_port(port, 30, proc)
        procs.append(spawn([*QGW, "dispatcher"], env))
        upstream = f"http://127.0.0.1:{up_port}"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=30,
                                     limits=httpx.Limits(max_connections=SUBMITTERS)) as http:
            r = await http.post("/admin/v1/api-keys", headers={
                "Authorization": f"Bearer {ADMIN}"}, json={"user_id": 1})
            auth = {"Authorization": f"Bearer {r.json()['key']}"}
            rows = [await run_case(http, auth, redis.url, upstream, honor, style, tasks)
                    for honor, style in ((False, "s"), (True, "s"), (True, "ms"), (True, "429"))]
        report(rows, tasks)
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--serve", type=int, metavar="PORT", help="run the upstream only")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
    else:
        asyncio.run(main(args.tasks))
