"""How honest is `wait_time`? Estimated against actual wait, 1,000 tasks.

Starts its own Redis, the mock upstream at a known latency, `qgw api` and one
`qgw dispatcher`, and registers an endpoint with a concurrency cap and no hint of its exec
time (avg_exec_ms left at its default of 1 s, four times too slow): a short warm-up lets the
scripts measure it.  Then 1,000 tasks arrive in bursts faster than the endpoint drains them,
so the line grows to hundreds and shrinks again.  Each task's estimate is the `wait_time` its
submit answered, made by the submit script at `created_at`; its actual wait is started_at minus
created_at (both on the Redis clock), once it ran.
Prints the ratio estimated / actual: median, 10th and 90th percentile and the share within
+-20%, over tasks that had to wait (tasks that found a free slot start within milliseconds;
they are counted apart).  A second, smaller run does the same for a rate-limited endpoint.
A third holds the line on a slow limiter (2 a second): a backlog submitted at once, then one
task at a time while it drains, so each estimate rests on where the limiter is (the head of the
line waits for the admission after the last one).  `wait_time` is whole seconds, rounded up:
below 5 s that rounding alone can miss by more than 20%, so the share within +-20% is also
given over waits of 5 s and more.
Loopback only; about a minute.  Usage: python bench/eta.py [--tasks N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import spawn
from tests.servers import QGW, RedisServer, free_port, stop, wait_port

ADMIN = "eta-admin-token-01234"  # QGW_ADMIN_TOKEN: 16 characters at least
LATENCY_MS = 250
BURSTS, BURST_GAP_S = 10, 0.6
MIN_WAIT_S = 0.05  # below this a task did not wait for a slot: it is reported apart
LONG_WAIT_S = 5.0  # from here on, rounding up to whole seconds costs 20% at most
SUBMITTERS = 16  # submits in flight: a burst, without queueing at the API for long


@dataclass
class Case:
    name: str
    endpoint: dict[str, object]
    tasks: int
    backlog: int = 0  # submitted at once before the bursts
    bursts: int = BURSTS
    gap_s: float = BURST_GAP_S
    warm: int = 0  # warm-up tasks; 0 = twice the cap (8 without one)


def _seconds(ts: str) -> float:
    return datetime.fromisoformat(ts).timestamp()


async def run_case(http: httpx.AsyncClient, auth: dict[str, str], upstream: str,
                   case: Case) -> None:
    url = f"{upstream}/{case.name}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await http.post("/admin/v1/endpoints", headers=admin,
                        json={"id": case.name, "target_url": url, **case.endpoint})
    r.raise_for_status()
    await asyncio.sleep(1.2)  # every process sees a new endpoint within a second

    async def submit() -> tuple[str, tuple[float, float]]:
        """The task id, its estimate and when it was made (created_at: the Redis clock, as
        started_at)."""
        async with sem:
            r = await http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
            r.raise_for_status()
            task = r.json()
            return task["task_id"], (float(task["wait_time"]), _seconds(task["created_at"]))

    async def finish(ids: list[str]) -> list[dict[str, object]]:
        out = []
        for tid in ids:
            while True:
                s = (await http.get(f"/api/v1/tasks/{tid}", headers=auth)).json()
                if s["task_status"] not in ("pending", "processing"):
                    out.append(s)
                    break
                await asyncio.sleep(0.2)
        return out

    sem = asyncio.Semaphore(SUBMITTERS)
    warm = [(await submit())[0] for _ in range(case.warm or 2 * int(str(case.endpoint.get(
        "max_concurrency") or 8)))]
    await finish(warm)

    estimates: dict[str, tuple[float, float]] = {}
    per_burst = (case.tasks - case.backlog) // case.bursts
    start = time.monotonic()
    estimates.update(await asyncio.gather(*(submit() for _ in range(case.backlog))))
    for b in range(case.bursts):
        results = await asyncio.gather(*(submit() for _ in range(per_burst)))
        estimates.update(results)
        await asyncio.sleep(max(0.0, start + (b + 1) * case.gap_s - time.monotonic()))
    done = await finish(list(estimates))
    elapsed = time.monotonic() - start

    ratios, prompt, long_waits = [], [], []
    for s in done:
        estimate, at = estimates[str(s["task_id"])]
        actual = _seconds(str(s["started_at"])) - at
        if actual < MIN_WAIT_S:
            prompt.append((estimate, actual))
        else:
            ratios.append(estimate / actual)
        if actual >= LONG_WAIT_S:
            long_waits.append(estimate / actual)
    ratios.sort()
    p = (lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]) if ratios else None
    within = sum(1 for x in ratios if 0.8 <= x <= 1.2) / len(ratios) if ratios else 0.0
    print(f"[{case.name}] {case.tasks} tasks, {case.endpoint}, upstream {LATENCY_MS} ms, "
          f"drained in {elapsed:.1f} s")
    if p:
        print(f"  estimated / actual wait over {len(ratios)} tasks that waited: "
              f"median {statistics.median(ratios):.3f}, p10 {p(0.1):.3f}, p90 {p(0.9):.3f}; "
              f"within +-20%: {within:.0%}")
    if long_waits:
        print(f"  within +-20% over the {len(long_waits)} waits of {LONG_WAIT_S:.0f} s and "
              f"more: {sum(1 for x in long_waits if 0.8 <= x <= 1.2) / len(long_waits):.0%}")
    if prompt:
        print(f"  {len(prompt)} tasks started at once (actual < {MIN_WAIT_S * 1000:.0f} ms): "
              f"their estimate was 0 for {sum(1 for e, _ in prompt if e == 0)}, median "
              f"{statistics.median(e for e, _ in prompt):.3f} s")


async def main(tasks: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgw-eta-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    mock_port, api_port = free_port(), free_port()
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/qgw.db",
           "QGW_DATA_DIR": str(tmp), "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning",
           "QGW_KEY_PREFIX": "eta"}
    procs = [spawn([*QGW, "mock-upstream", "--port", str(mock_port), "--latency-ms",
                    str(LATENCY_MS)]),
             spawn([*QGW, "api", "--port", str(api_port)], env)]
    try:
        for port, proc in zip((mock_port, api_port), procs, strict=True):
            wait_port(port, 30, proc)
        procs.append(spawn([*QGW, "dispatcher"], env))
        upstream = f"http://127.0.0.1:{mock_port}"
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", limits=limits,
                                     timeout=30) as http:
            r = await http.post("/admin/v1/api-keys", headers={
                "Authorization": f"Bearer {ADMIN}"}, json={"user_id": 1})
            auth = {"Authorization": f"Bearer {r.json()['key']}"}
            await run_case(http, auth, upstream, Case("capped", {"max_concurrency": 16}, tasks))
            await run_case(http, auth, upstream, Case(
                "rated", {"rate": 40, "interval_ms": 1000}, tasks // 2))
            await run_case(http, auth, upstream, Case(
                "held", {"rate": 2, "interval_ms": 1000}, 60, backlog=30, bursts=30, gap_s=0.7,
                warm=2))
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    asyncio.run(main(parser.parse_args().tasks))
