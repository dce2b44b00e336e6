"""Rate limits under a backlog: the gateway's limiters vs the seed's loop, in the same run.

For rates of 50, 200 and 1000 calls per 1000 ms (sliding window), a backlog of 5 s worth of tasks
is drained into the mock upstream (latency 0) by
  ours   one or two `qgw dispatcher` processes (a call passes the limit in the claim script
         and again right before it is sent, app/ratelimit);
  seed   one or two processes running a faithful copy of the seed's loop (seeds/002): BZPOPMIN
         a task, check a sliding window whose member is the caller's millisecond, and when
         limited put the task back and sleep the whole loop, 1 s doubling, capped at the
         interval, at most 5 tries, un-recording the check that finally passes.
Measured on what the upstream received (arrival times in its log), each call against the one
`rate` places before it (the steady state: the opening allowance does not count):
  delivered  interval / mean gap between call j and call j - rate: 1.000 is exactly the rate
  worst      the most calls in any window [t, t + interval), at the upstream and on the
             limiter's own clock (ours: the claim's Redis time; seed: the millisecond it used)
  slot       from a slot opening (the call `rate` places back + interval) to the call using
             it, p50 and p99 in ms; negative means the upstream saw that window overfull
  transit    from admission to arrival at the upstream, p99 in ms: the dispatch jitter that
             the upstream sees on top of the limiter's exact windows
Then, with --cases multi,cost (ours only, 1 and 2 dispatchers), endpoints under several limits
at once (docs/api.md `limits`):
  multi  50/s (the main limit) + 120 per 5 s, where the second binds (a shortened 50/s + 1000/min)
  cost   200 cost units per second (`per: "cost"`), tasks of random cost 1..5, no request limit
  paced  the same under a looser 100/s request limit too (the cost limit binds; the main
         limit's pacing spreads each window's admissions)
measured on the upstream's log against every limit, each call against the earliest call whose
units, with its own, exceed the limit's rate (the same steady-state rule as above):
  delivered  units per window over those spans / rate, for the limit that binds (the highest)
  over       sliding windows [t, t + interval) at the upstream holding more than the rate, per
             limit (target 0)
Loopback only; bounded to about three minutes.  Run: .venv/bin/python bench/ratelimit.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import migrate
from app.main import create_app
from app.runtime import Runtime
from app.settings import Settings
from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port
from tests.test_ratelimit import most_in_window

RATES = (50, 200, 1000)
INTERVAL_MS = 1000
BACKLOG_S = 5
BUDGET_S = 170.0  # no run starts, and every run is cut short, past this: the whole < 3 min
STARTED = time.monotonic()


# -- measuring -------------------------------------------------------------------------------

@dataclass
class Row:
    impl: str
    procs: int
    rate: int
    calls: int
    delivered: float
    worst_upstream: int
    worst_limiter: int
    slot_p50: float
    slot_p99: float
    transit_p99: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(impl: str, procs: int, rate: int, arrived: dict[str, float],
            admitted: dict[str, float]) -> Row:
    """arrived: call id -> arrival at the upstream (ms); admitted: call id -> admission (ms)."""
    t = sorted(arrived.values())
    # Steady state: each call against the one `rate` places before it, so neither the opening
    # allowance nor the spread of the first and last bursts counts.
    periods = [t[j] - t[j - rate] for j in range(rate, len(t))]
    delivered = INTERVAL_MS / (sum(periods) / len(periods)) if periods else float("nan")
    slot = [p - INTERVAL_MS for p in periods]
    transit = [arrived[k] - admitted[k] for k in arrived if k in admitted]
    return Row(impl, procs, rate, len(t), delivered, most_in_window(t, INTERVAL_MS),
               most_in_window(sorted(admitted.values()), INTERVAL_MS), percentile(slot, 0.5),
               percentile(slot, 0.99), percentile(transit, 0.99))


async def arrivals(mock: str, path: str, n: int, timeout: float) -> list[dict[str, object]]:
    """The upstream's log of `path` once it holds n calls (or the time is up)."""
    deadline = min(time.monotonic() + timeout, STARTED + BUDGET_S)
    async with httpx.AsyncClient() as http:
        while True:
            received = (await http.get(f"{mock}/_mock/stats")).json()["received"]
            if received >= n or time.monotonic() > deadline:
                log: list[dict[str, object]] = (await http.get(f"{mock}/_mock/log")).json()
                return [e for e in log if e["path"] == path]
            await asyncio.sleep(0.25)


async def reset(mock: str) -> None:
    async with httpx.AsyncClient() as http:
        (await http.post(f"{mock}/_mock/reset")).raise_for_status()


# -- ours ------------------------------------------------------------------------------------

async def run_ours(api: Api, env: dict[str, str], mock: str, rate: int, procs: int) -> Row:
    eid, n = f"ours-{rate}-{procs}", rate * BACKLOG_S
    url = f"{mock}/{eid}"
    await api.admin("POST", "/admin/v1/endpoints", id=eid, target_url=url, rate=rate,
                    interval_ms=INTERVAL_MS, max_queue_len=0)
    ids = await api.submit_all(url, n)
    log = await drain(api, env, mock, eid, n, procs, timeout=BACKLOG_S * 4 + 10)
    async with api.rt.redis.pipeline(transaction=False) as pipe:
        for tid in ids:
            pipe.hget(api.rt.keys.task(tid), "started_at")
        started = dict(zip(ids, await pipe.execute(), strict=True))
    admitted = {k: float(v) for k, v in started.items() if v is not None}
    return measure("ours", procs, rate, by_call(log), admitted)


async def drain(api: Api, env: dict[str, str], mock: str, eid: str, n: int, procs: int,
                timeout: float) -> list[dict[str, object]]:
    """Release the endpoint's backlog to `procs` dispatcher processes at once; the upstream's
    log of its calls."""
    await api.admin("PATCH", f"/admin/v1/endpoints/{eid}", enabled=False)  # hold the backlog
    await reset(mock)
    workers = [spawn([*QGW, "dispatcher"], env) for _ in range(procs)]
    try:
        await blocked_on(api.rt.redis, procs)  # until every dispatcher is up
        await api.admin("PATCH", f"/admin/v1/endpoints/{eid}", enabled=True)
        return await arrivals(mock, f"/{eid}", n, timeout=timeout)
    finally:
        for w in workers:
            stop(w)


def by_call(log: list[dict[str, object]]) -> dict[str, float]:
    """Arrival time (ms) of each call, by the Idempotency-Key the caller sent."""
    return {str(e["idempotency_key"]): float(str(e["t"])) for e in log}


@dataclass
class Api:
    """The gateway in-process, spoken to over its HTTP API (as tests/conftest.py does)."""

    rt: Runtime
    http: httpx.AsyncClient
    auth: dict[str, str] = field(default_factory=dict)

    async def admin(self, method: str, path: str, **body: Any) -> dict[str, Any]:
        r = await self.http.request(method, path, json=body,
                                    headers={"Authorization": "Bearer bench-admin-token-0123"})
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    async def submit_all(self, url: str, n: int, costs: list[int] | None = None) -> list[str]:
        if not self.auth:
            key = (await self.admin("POST", "/admin/v1/api-keys", user_id=1))["key"]
            self.auth = {"Authorization": f"Bearer {key}"}
        ids: list[str] = []
        for i in range(n):
            task: dict[str, Any] = {"target_url": url, "body": str(i)}
            if costs:
                task["cost"] = costs[i]
            r = await self.http.post("/api/v1/tasks", headers=self.auth, json=task)
            r.raise_for_status()
            ids.append(r.json()["task_id"])
        return ids


async def blocked_on(redis: Redis, count: int, timeout: float = 30) -> None:
    """Wait until `count` dispatchers block on their wake markers: they are up and idle."""
    deadline = time.monotonic() + timeout
    while sum(c.get("cmd") == "bzpopmin" for c in await redis.client_list()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("dispatchers did not start")
        await asyncio.sleep(0.1)


# -- several limits, and cost ----------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    rate: int  # the main limit per INTERVAL_MS (0 = none)
    limits: tuple[tuple[int, int, str], ...]  # further sliding windows: rate, interval, per
    tasks: int
    costs: tuple[int, int] = (1, 1)  # each task's cost, drawn uniformly


CASES = {
    "multi": Case("multi", 50, ((120, 5000, "request"),), 360),
    "cost": Case("cost", 0, ((200, 1000, "cost"),), 400, (1, 5)),
    "paced": Case("paced", 100, ((200, 1000, "cost"),), 400, (1, 5)),
}


@dataclass
class LimitsRow:
    case: str
    procs: int
    calls: int
    delivered: list[float]  # per limit, the main one first
    over: list[int]  # per limit


def against(calls: list[tuple[float, int]], rate: int, interval: int) -> tuple[float, int]:
    """(delivered, windows over) of time-ordered (arrival, units) calls under one limit. Each
    call j against the latest call i whose units with j's, and all between, exceed the rate: a
    limit kept means i arrived at least `interval` before j; the units after i, over that span,
    are what the limit let through (for a request limit: `rate` calls, i = j - rate)."""
    spent = spans = 0.0
    over, i, units = 0, 0, 0
    for t, c in calls:
        units += c
        while units > rate:
            units -= calls[i][1]
            i += 1
        if i == 0:
            continue  # the opening allowance
        spent += units
        spans += t - calls[i - 1][0]
        over += t - calls[i - 1][0] < interval
    return (interval * spent / spans / rate if spans else float("nan")), over


async def run_limits(api: Api, env: dict[str, str], mock: str, case: Case, procs: int
                     ) -> LimitsRow:
    eid = f"{case.name}-{procs}"
    url = f"{mock}/{eid}"
    limits = [{"limiter": "sliding_window", "rate": r, "interval_ms": i, "per": per}
              for r, i, per in case.limits]
    await api.admin("POST", "/admin/v1/endpoints", id=eid, target_url=url, rate=case.rate,
                    interval_ms=INTERVAL_MS, max_queue_len=0, limits=limits)
    rng = random.Random(procs)
    costs = [rng.randint(*case.costs) for _ in range(case.tasks)]
    ids = await api.submit_all(url, case.tasks, costs if case.costs != (1, 1) else None)
    cost_of = dict(zip(ids, costs, strict=True))
    log = await drain(api, env, mock, eid, case.tasks, procs, timeout=60)
    calls = sorted((t, cost_of[k]) for k, t in by_call(log).items())
    checks = ([(case.rate, INTERVAL_MS, "request")] if case.rate else []) + list(case.limits)
    results = [against([(t, c if per == "cost" else 1) for t, c in calls], r, i)
               for r, i, per in checks]
    return LimitsRow(case.name, procs, len(calls), [d for d, _ in results],
                     [o for _, o in results])


def limits_table(rows: list[LimitsRow]) -> str:
    head = (f"{'case':<9} {'procs':>5} {'limits':<26} {'calls':>5} {'delivered/tightest':>18} "
            f"{'per limit':>13} {'windows over':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        case = CASES[r.case]
        limits = ([f"{case.rate}/{INTERVAL_MS}ms"] if case.rate else []) + [
            f"{n}{' cost' if per == 'cost' else ''}/{i}ms" for n, i, per in case.limits]
        lines.append(
            f"{r.case:<9} {r.procs:>5} {' + '.join(limits):<26} {r.calls:>5} "
            f"{max(r.delivered):>18.3f} {' '.join(f'{d:.3f}' for d in r.delivered):>13} "
            f"{' + '.join(str(o) for o in r.over):>12}")
    return "\n".join(lines)


# -- the seed --------------------------------------------------------------------------------

# The seed's sliding window, with the caller's clock and its millisecond as the member.
SEED_LIMIT = """
local now, interval, rate = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, now - interval)
if redis.call('ZCARD', KEYS[1]) >= rate then return 1 end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], interval)
return 0
"""


async def seed_loop(redis_url: str, name: str, rate: int, interval_ms: int) -> None:
    """The seed's dispatcher, step for step (seeds/002), for one queue."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    limit = redis.register_script(SEED_LIMIT)
    queue, window = f"seed:{name}:q", f"seed:{name}:rl"
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))
    running: set[asyncio.Task[None]] = set()

    async def limited(now: int) -> bool:
        return bool(await limit(keys=[window], args=[now, interval_ms, rate]))

    async def execute(task_id: str, task: dict[str, str], admitted: int) -> None:
        async with http.post(task["url"], data=task["body"],
                             headers={"Idempotency-Key": task_id}) as resp:
            text = await resp.text()
        await redis.set(f"seed:{name}:result:{task_id}", text, ex=3600)
        await redis.hset(f"seed:{name}:admitted", task_id, admitted)

    while True:
        popped = await redis.bzpopmin(queue, timeout=1)
        if popped is None:
            continue
        task_id, score = str(popped[1]), float(popped[2])
        task = json.loads(await redis.get(f"seed:{name}:task:{task_id}") or "{}")
        now = int(time.time() * 1000)
        if await limited(now):
            await redis.zadd(queue, {task_id: score})  # put the task back
            for retry in range(5):
                await asyncio.sleep(min(1.0 * 2 ** retry, interval_ms / 1000))
                now = int(time.time() * 1000)
                if not await limited(now):
                    await redis.zrem(window, now)  # un-record the check that passed
                    break
            continue
        job = asyncio.create_task(execute(task_id, task, now))  # `go Execute(task)`
        running.add(job)
        job.add_done_callback(running.discard)


async def run_seed(redis_url: str, mock: str, rate: int, procs: int) -> Row:
    name, n = f"{rate}-{procs}", rate * BACKLOG_S
    url = f"{mock}/seed-{name}"
    async with Redis.from_url(redis_url, decode_responses=True) as redis:
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(n):
                tid = f"{name}-{i:06d}"
                pipe.set(f"seed:{name}:task:{tid}", json.dumps({"url": url, "body": str(i)}))
                pipe.zadd(f"seed:{name}:q", {tid: i})  # -priority * 1e9 + ts, one priority
            await pipe.execute()
        await reset(mock)
        workers = [spawn([sys.executable, __file__, "--seed", redis_url, name, str(rate)])
                   for _ in range(procs)]
        try:
            log = await arrivals(mock, f"/seed-{name}", n, timeout=BACKLOG_S * 6 + 15)
        finally:
            for w in workers:
                stop(w)
        raw = await redis.hgetall(f"seed:{name}:admitted")
    return measure("seed", procs, rate, by_call(log), {str(k): float(v) for k, v in raw.items()})


# -- the run ---------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    head = (f"{'impl':<5} {'procs':>5} {'rate/s':>6} {'calls':>5} {'delivered':>9} "
            f"{'worst@upstream':>14} {'worst@limiter':>13} {'slot p50':>8} {'slot p99':>8} "
            f"{'transit p99':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.impl:<5} {r.procs:>5} {r.rate:>6} {r.calls:>5} {r.delivered:>9.3f} "
            f"{f'{r.worst_upstream}/{r.rate}':>14} {f'{r.worst_limiter}/{r.rate}':>13} "
            f"{r.slot_p50:>8.1f} {r.slot_p99:>8.1f} {r.transit_p99:>11.1f}")
    return "\n".join(lines)


async def main(rates: tuple[int, ...], impls: tuple[str, ...], procs_list: tuple[int, ...],
               cases: tuple[str, ...] = ()) -> None:
    began = STARTED
    tmp = Path(tempfile.mkdtemp(prefix="qgw-bench-rl-"))
    redis_server = RedisServer(tmp / "redis")
    redis_server.start()
    mock_port = free_port()
    mock_proc = spawn([*QGW, "mock-upstream", "--port", str(mock_port)])
    settings = Settings(redis_url=redis_server.url, database_url=f"sqlite+aiosqlite:///{tmp}/db",
                        data_dir=tmp, key_prefix="bench", admin_token="bench-admin-token-0123",
                        permit_secret="bench")
    env = {"QGW_REDIS_URL": redis_server.url, "QGW_DATABASE_URL": settings.db_url,
           "QGW_DATA_DIR": str(tmp), "QGW_KEY_PREFIX": "bench",
           "QGW_ADMIN_TOKEN": "bench-admin-token-0123",
           "QGW_PERMIT_SECRET": "bench", "QGW_LOG_LEVEL": "warning"}
    rt = Runtime(settings)
    rows: list[Row] = []
    limits_rows: list[LimitsRow] = []
    try:
        wait_port(mock_port, 30, mock_proc)
        await asyncio.to_thread(migrate.upgrade, settings.db_url)
        await rt.start()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(rt, manage=False)),
                                 base_url="http://gateway")
        api = Api(rt, http)
        mock = f"http://127.0.0.1:{mock_port}"
        for rate in rates:
            for impl in impls:
                for procs in procs_list:
                    if time.monotonic() - began > BUDGET_S:
                        print(f"skipped {impl} x{procs} at {rate}/s: time budget spent")
                        continue
                    row = (await run_ours(api, env, mock, rate, procs) if impl == "ours"
                           else await run_seed(redis_server.url, mock, rate, procs))
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
        for name in cases:
            for procs in procs_list:
                if time.monotonic() - began > BUDGET_S:
                    print(f"skipped {name} x{procs}: time budget spent")
                    continue
                limits_rows.append(await run_limits(api, env, mock, CASES[name], procs))
                print(limits_table(limits_rows[-1:]).splitlines()[-1], flush=True)
        await http.aclose()
    finally:
        await rt.stop()
        stop(mock_proc)
        redis_server.stop()
    print(f"\nsliding window, interval {INTERVAL_MS} ms, backlog {BACKLOG_S} s, mock latency 0, "
          f"{time.monotonic() - began:.0f} s in all\n")
    if rows:
        print(table(rows))
    if limits_rows:
        print(f"\n{limits_table(limits_rows)}")


def seed_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("redis_url")
    p.add_argument("name")
    p.add_argument("rate", type=int)
    args = p.parse_args(argv)
    asyncio.run(seed_loop(args.redis_url, args.name, args.rate, INTERVAL_MS))


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seed"]:
        seed_main(sys.argv[2:])
    else:
        cli = argparse.ArgumentParser(description="rate limits: ours vs the seed's loop")
        cli.add_argument("--rates", type=ints, default=RATES, help="e.g. 50,200,1000")
        cli.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=("ours", "seed"))
        cli.add_argument("--procs", type=ints, default=(1, 2), help="dispatcher processes")
        cli.add_argument("--cases", type=lambda s: tuple(c for c in s.split(",") if c),
                         default=tuple(CASES), help=f"of {','.join(CASES)}; '' for none")
        a = cli.parse_args()
        asyncio.run(main(a.rates, a.impls, a.procs, a.cases))
