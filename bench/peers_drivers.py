"""One round of one Python queue for bench/peers.py: ours, SAQ or arq.

Run as `python bench/peers_drivers.py NAME REDIS_URL N CONCURRENCY`; prints one JSON line.
Each round is a fresh process against a flushed Redis, as BullMQ's driver (peers_bullmq.mjs):
1. enqueue N no-op jobs, CONCURRENCY callers each awaiting its own one after another;
2. start a worker of CONCURRENCY and time it until all N are acknowledged.
Redis CPU is the server's `INFO cpu` (used_cpu_sys + used_cpu_user) delta over each phase; client
CPU this process's own (time.process_time) over it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A phase that takes longer has failed.
DEADLINE_S = float(os.environ.get("PEERS_DEADLINE_S", "120"))


@dataclass
class Finishes:
    """Acknowledgement times, and the event set at the N-th."""

    n: int
    times: list[float] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) >= self.n:
            self.done.set()

    def max_gap_ms(self) -> float:
        t = sorted(self.times)
        return max((b - a for a, b in itertools.pairwise(t)), default=0.0) * 1000


def redis_cpu(r: redis.Redis) -> float:
    info: dict[str, Any] = r.info("cpu")  # type: ignore[assignment]
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def enqueue_all(n: int, concurrency: int, one: Callable[[int], Awaitable[Any]]) -> None:
    counter = iter(range(n))

    async def caller() -> None:
        for i in counter:
            await one(i)

    await asyncio.gather(*(caller() for _ in range(concurrency)))


async def wait_done(fin: Finishes) -> None:
    try:
        await asyncio.wait_for(fin.done.wait(), DEADLINE_S)
    except TimeoutError:
        raise SystemExit(f"only {len(fin.times)} of {fin.n} acknowledged in "
                         f"{DEADLINE_S:.0f} s") from None


@dataclass
class Round:
    """Phase timings and Redis CPU, filled in by a driver."""

    url: str
    n: int
    concurrency: int
    fin: Finishes = field(init=False)
    # (perf_counter, Redis CPU, this process's CPU) at each phase's start and end
    marks: list[tuple[float, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fin = Finishes(self.n)
        self._r = redis.Redis.from_url(self.url)

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), redis_cpu(self._r), time.process_time()))

    def report(self) -> dict[str, float]:
        (t0, c0, p0), (t1, c1, p1), (t2, c2, p2), (t3, c3, p3) = self.marks
        n = self.n
        return {"enqueue_per_s": n / (t1 - t0), "process_per_s": n / (t3 - t2),
                "cpu_enq_us": (c1 - c0) / n * 1e6, "cpu_proc_us": (c3 - c2) / n * 1e6,
                "client_enq_us": (p1 - p0) / n * 1e6, "client_proc_us": (p3 - p2) / n * 1e6,
                "max_gap_ms": self.fin.max_gap_ms()}


# -- ours: TaskQueue.submit (the submit script) and the real Dispatcher, upstream stubbed --------

async def run_ours(rd: Round) -> None:
    from app import migrate
    from app.endpoints import EndpointConfig
    from app.models import SubmitRequest
    from app.queue import dispatcher as dispatcher_mod
    from app.queue.upstream import Outcome
    from app.runtime import Runtime, redis_client
    from app.settings import Settings
    from app.store import ApiKey

    async def no_call(*_: Any, **__: Any) -> Outcome:
        return Outcome(200, "ok")

    class Timed(dispatcher_mod.Dispatcher):
        async def _finish(self, claim: Any, outcome: Outcome, exec_ms: float) -> None:
            await super()._finish(claim, outcome, exec_ms)
            rd.fin.add()

    dispatcher_mod.call = no_call  # type: ignore[assignment]  # the upstream call, stubbed
    with tempfile.TemporaryDirectory(prefix="qgw-peers-") as tmp:
        s = Settings(redis_url=rd.url, database_url=f"sqlite+aiosqlite:///{tmp}/q.db",
                     data_dir=Path(tmp), admin_token="peers-bench-admin-token", key_prefix="peers",
                     dispatch_concurrency=rd.concurrency)
        await asyncio.to_thread(migrate.upgrade, s.db_url)
        rt = Runtime(s)
        await rt.start()
        ep = await rt.endpoints.create(EndpointConfig(
            id="noop", target_url="http://127.0.0.1:9/noop", max_queue_len=0))
        key = ApiKey("k", 1, "default", 0, 0)
        req = SubmitRequest(target_url="http://127.0.0.1:9/noop", body="{}")
        rd.mark()
        await enqueue_all(rd.n, rd.concurrency, lambda _: rt.queue.submit(key, ep, req, None))
        rd.mark()
        blocking = redis_client(rt.redis_url, s.redis_timeout_s + 2)
        disp = Timed(rt.redis, blocking, rt.keys, rt.queue.scripts, rt.registry, s,
                     None)  # type: ignore[arg-type]  # no HTTP client: the call is stubbed
        rd.mark()
        disp.start()
        await wait_done(rd.fin)
        rd.mark()
        await disp.stop(grace_s=1)
        await blocking.aclose()
        await rt.stop()


# -- SAQ ------------------------------------------------------------------------------------------

async def run_saq(rd: Round) -> None:
    from saq import Queue, Worker

    async def noop(ctx: Any) -> None:
        return None

    async def after(ctx: Any) -> None:
        rd.fin.add()

    queue = Queue.from_url(rd.url, name="peers")
    await queue.connect()
    rd.mark()
    await enqueue_all(rd.n, rd.concurrency, lambda _: queue.enqueue("noop"))
    rd.mark()
    worker = Worker(queue, functions=[("noop", noop)], concurrency=rd.concurrency,
                    after_process=after)
    rd.mark()
    task = asyncio.create_task(worker.start())
    await wait_done(rd.fin)
    rd.mark()
    await worker.stop()
    await task
    await queue.disconnect()


# -- arq ------------------------------------------------------------------------------------------

async def run_arq(rd: Round) -> None:
    from arq import Worker, create_pool, func
    from arq.connections import RedisSettings

    async def noop(ctx: Any) -> None:
        return None

    async def after(ctx: Any) -> None:
        rd.fin.add()

    settings = RedisSettings.from_dsn(rd.url)
    pool = await create_pool(settings)
    rd.mark()
    await enqueue_all(rd.n, rd.concurrency, lambda _: pool.enqueue_job("noop"))
    rd.mark()
    worker = Worker(functions=[func(noop, name="noop")], redis_settings=settings,
                    max_jobs=rd.concurrency, poll_delay=0.01, after_job_end=after,
                    handle_signals=False)
    rd.mark()
    task = asyncio.create_task(worker.main())
    await wait_done(rd.fin)
    rd.mark()
    await worker.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await pool.aclose()


DRIVERS: dict[str, Callable[[Round], Awaitable[None]]] = {
    "ours": run_ours, "saq": run_saq, "arq": run_arq}


def main() -> None:
    name, url, n, conc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    logging.basicConfig(level=os.environ.get("PEERS_LOG", "ERROR"))
    rd = Round(url, n, conc)
    # Ours on the loop `qgw api` and `qgw dispatcher` run on (uvloop, app/cli.py); the peers
    # on asyncio's own, as their workers start by default.
    factory = None
    if name == "ours":  # the peers' venv has no gateway dependencies: imported for ours only
        from app.cli import event_loop_factory

        factory = event_loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(DRIVERS[name](rd), 4 * DEADLINE_S))
    print(json.dumps(rd.report()), flush=True)


if __name__ == "__main__":
    main()
