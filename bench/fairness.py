"""Fair turns: one user's backlog against a few small users, `fifo` against `per_user`.

Starts its own Redis, the mock upstream (5 ms), `qgw api` and one `qgw dispatcher`. For each
fairness mode it registers a paused endpoint limited to --rate calls a second, has user A
submit --big tasks, then users B-E --small each, all at priority 0, and unpauses it: the
whole line is then dispatched at the fixed rate, one call a turn. From the mock upstream's log
(the calls in the order they were made) it reports, per small user, the turn of its last call
against the bound users x its task count, and that call's time since the first call (a turn
is 1 / rate s; a call ends 5 ms later); and Jain's fairness index (sum x)^2 / (n sum x^2) of
the calls each user got while every user still had tasks waiting (from the first call to the
first user's last one), which is 1.0 when they share equally and 1/n when one user takes all.
Then `weighted`: users of tiers weighing 3, 2 and 1 (PUT /admin/v1/tiers) submit 3, 2 and 1 x
--weighted tasks to a paused endpoint, unpaused at once: each user's share of the calls while
all still waited, against its weight's share (50/33/17%), and the worst of every window of 200
consecutive calls (the largest deviation from a share, relative to it).
Loopback only; with the defaults (5,000 + 4 x 20 tasks at 200/s) about a minute a mode.
Usage: python bench/fairness.py [--big N] [--small N] [--rate R] [--weighted N]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "fairness-admin-token-0123"  # QGW_ADMIN_TOKEN: 16 characters at least
USERS = "ABCDE"  # A has the backlog
SUBMITTERS = 16  # submits in flight


def jain(counts: list[int]) -> float:
    total, squares = sum(counts), sum(c * c for c in counts)
    return total * total / (len(counts) * squares) if squares else 1.0


async def run_mode(http: httpx.AsyncClient, keys: dict[str, dict[str, str]], upstream: str,
                   mode: str, args: argparse.Namespace) -> None:
    admin, ep = {"Authorization": f"Bearer {ADMIN}"}, f"fair-{mode.replace('_', '-')}"
    url = f"{upstream}/{ep}"
    r = await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": ep, "target_url": url, "rate": args.rate, "interval_ms": 1000,
        "fairness": mode, "paused": True, "max_queue_len": 0})
    r.raise_for_status()
    sem, owner = asyncio.Semaphore(SUBMITTERS), {}

    async def submit(user: str) -> None:
        async with sem:
            r = await http.post("/api/v1/tasks", headers=keys[user], json={"target_url": url})
            r.raise_for_status()
            owner[r.json()["task_id"]] = user

    await asyncio.gather(*(submit("A") for _ in range(args.big)))
    for user in USERS[1:]:  # after A, one user after the other
        await asyncio.gather(*(submit(user) for _ in range(args.small)))
    r = await http.patch(f"/admin/v1/endpoints/{ep}", headers=admin, json={"paused": False})
    r.raise_for_status()
    calls = await _calls(upstream, ep, len(owner))
    t0 = calls[0][0]
    order = [owner[tid] for _, tid in calls]
    last = {u: max(i for i, o in enumerate(order) if o == u) for u in USERS}
    window = min(last.values()) + 1  # every user still had tasks waiting
    index = jain([order[:window].count(u) for u in USERS])
    bound = len(USERS) * args.small
    print(f"[{mode}] {args.big} + {len(USERS) - 1} x {args.small} tasks at {args.rate}/s, "
          f"drained in {(calls[-1][0] - t0) / 1000:.1f} s")
    print("  user  last call's turn  bound (users x tasks)  its time since the first call")
    for u in USERS[1:]:
        at = (calls[last[u]][0] - t0) / 1000
        print(f"  {u}     {last[u] + 1:>16}  {bound:>21}  {at:>8.2f} s")
    print(f"  Jain's index over the first {window} calls (all {len(USERS)} users waiting): "
          f"{index:.3f}")


WEIGHTS = {"gold": 3, "silver": 2, "bronze": 1}
WINDOW = 200


async def run_weighted(http: httpx.AsyncClient, upstream: str, args: argparse.Namespace) -> None:
    admin, ep = {"Authorization": f"Bearer {ADMIN}"}, "fair-weighted"
    url = f"{upstream}/{ep}"
    r = await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": ep, "target_url": url, "rate": args.rate, "interval_ms": 1000,
        "fairness": "weighted", "paused": True, "max_queue_len": 0})
    r.raise_for_status()
    sem, owner = asyncio.Semaphore(SUBMITTERS), {}

    async def submit(tier: str, key: dict[str, str]) -> None:
        async with sem:
            r = await http.post("/api/v1/tasks", headers=key, json={"target_url": url})
            r.raise_for_status()
            owner[r.json()["task_id"]] = tier

    for n, (tier, weight) in enumerate(WEIGHTS.items(), 100):
        (await http.put(f"/admin/v1/tiers/{tier}", headers=admin,
                        json={"weight": weight})).raise_for_status()
        r = await http.post("/admin/v1/api-keys", headers=admin,
                            json={"user_id": n, "tier": tier})
        key = {"Authorization": f"Bearer {r.json()['key']}"}
        await asyncio.gather(*(submit(tier, key) for _ in range(weight * args.weighted)))
    (await http.patch(f"/admin/v1/endpoints/{ep}", headers=admin,
                      json={"paused": False})).raise_for_status()
    order = [owner[tid] for _, tid in await _calls(upstream, ep, len(owner))]
    last = min(max(i for i, o in enumerate(order) if o == t) for t in WEIGHTS) + 1
    total = sum(WEIGHTS.values())
    worst = max(abs(order[s:s + WINDOW].count(t) - WINDOW * w / total) / (WINDOW * w / total)
                for s in range(max(1, last - WINDOW + 1)) for t, w in WEIGHTS.items())
    sizes = " + ".join(f"{w * args.weighted} ({t}, weight {w})" for t, w in WEIGHTS.items())
    print(f"[weighted] {sizes} tasks at {args.rate}/s")
    for tier, weight in WEIGHTS.items():
        got = order[:last].count(tier) / last
        print(f"  {tier:<7} share of the first {last} calls {got:6.1%}"
              f"  (weight's share {weight / total:6.1%})")
    print(f"  worst deviation from a share over any {WINDOW} consecutive calls: {worst:.1%}")


async def _calls(upstream: str, ep: str, total: int) -> list[tuple[float, str]]:
    """(time ms, task id) of the endpoint's calls in the order the upstream got them."""
    async with httpx.AsyncClient(base_url=upstream, timeout=60) as mock:
        while True:
            log = (await mock.get("/_mock/log")).json()
            calls = [(e["t"], e["idempotency_key"]) for e in log if e["path"] == f"/{ep}"]
            if len(calls) >= total:
                return calls
            await asyncio.sleep(1)


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-fair-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    mock_port, api_port = free_port(), free_port()
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning",
           "QGW_KEY_PREFIX": "fair"}
    procs = [spawn([*QGW, "mock-upstream", "--port", str(mock_port), "--latency-ms", "5"]),
             spawn([*QGW, "api", "--port", str(api_port)], env)]
    try:
        for port, proc in zip((mock_port, api_port), procs, strict=True):
            wait_port(port, 30, proc)
        procs.append(spawn([*QGW, "dispatcher"], env))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as http:
            keys = {}
            for n, user in enumerate(USERS, 1):
                r = await http.post("/admin/v1/api-keys", headers={
                    "Authorization": f"Bearer {ADMIN}"}, json={"user_id": n})
                keys[user] = {"Authorization": f"Bearer {r.json()['key']}"}
            for mode in ("fifo", "per_user"):
                await run_mode(http, keys, f"http://127.0.0.1:{mock_port}", mode, args)
            await run_weighted(http, f"http://127.0.0.1:{mock_port}", args)
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big", type=int, default=5000)
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--weighted", type=int, default=300,
                        help="tasks per unit of weight in the weighted case")
    asyncio.run(main(parser.parse_args()))
