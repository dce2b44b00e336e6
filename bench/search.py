"""The operator's search (GET /admin/v1/tasks, app/queue/search.py) on 1,000,000 task_results
rows in SQLite: the latency of its SQL part, p50 and p99 per kind of filter, through the same
async engine and queries the route runs. Bounded, local: a temp file, about a minute on two
cores.

    .venv/bin/python bench/search.py [--rows N] [--runs N]

Rows: 20 endpoints, ended over 3 days (the default retention), 85% completed, 8% failed,
4% cancelled, 3% expired, time-ordered ids (like uuid7) with their endpoint after a dot.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import migrate
from app.db import make_engine
from app.queue.listing import Cursor
from app.queue.search import FINISHED, TaskFilter, from_sql

ENDPOINTS = [f"ep{i}" for i in range(20)]
STATUSES = ["completed"] * 85 + ["failed"] * 8 + ["cancelled"] * 4 + ["expired"] * 3
SPAN_MS = 3 * 86400 * 1000
START = datetime(2026, 11, 1)
CHUNK = 50_000


def load(path: Path, rows: int) -> list[str]:
    """Fill the table (migrated: every index the app has; no ANALYZE, as in production);
    returns a sample of the ids."""
    rnd, sample = random.Random(7), []
    with sqlite3.connect(path) as db:
        for first in range(0, rows, CHUNK):
            batch = []
            for n in range(first, min(rows, first + CHUNK)):
                at_ms = n * SPAN_MS // rows
                ended = START + timedelta(milliseconds=at_ms)
                e, status = rnd.choice(ENDPOINTS), rnd.choice(STATUSES)
                tid = f"{at_ms:012x}{rnd.getrandbits(80):020x}.{e}"
                dead = status in ("failed", "expired")
                batch.append((tid, 1, e, "offline", status,
                              "upstream answered 500" if dead else "ok", 500 if dead else 200,
                              1, ended - timedelta(seconds=2), ended - timedelta(seconds=1),
                              ended, 0, '{"method": "POST"}' if dead else None))
                if n % 1000 == 0:
                    sample.append(tid)
            db.executemany("INSERT INTO task_results (task_id, user_id, endpoint, type, status,"
                           " result, result_status_code, attempts, created_at, started_at, "
                           "ended_at, priority, request) VALUES "
                           "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", batch)
    return sample


def kinds(sample: list[str]) -> dict[str, Callable[[random.Random], tuple[TaskFilter, list[str],
                                                                            Cursor | None]]]:
    """Each kind of search: a filter, the statuses it asks for, a cursor."""
    def window(r: random.Random) -> tuple[datetime, datetime]:
        since = START + timedelta(milliseconds=r.randrange(SPAN_MS - 3_600_000))
        return since, since + timedelta(hours=1)

    def deep(r: random.Random) -> Cursor:
        tid = r.choice(sample)
        return Cursor(_epoch_ms(START) + int(tid[:12], 16), tid)  # its id names when it ended

    return {
        "status=failed": lambda r: (TaskFilter("failed"), ["failed"], None),
        "status=failed&endpoint": lambda r: (
            TaskFilter("failed", r.choice(ENDPOINTS)), ["failed"], None),
        "status=failed&since&until (1 h)": lambda r: (
            TaskFilter("failed", None, *window(r)), ["failed"], None),
        "any finished status": lambda r: (TaskFilter(), list(FINISHED), None),
        "id prefix (10 chars)": lambda r: (
            TaskFilter(None, None, None, None, r.choice(sample)[:10]), list(FINISHED), None),
        "status=failed, a page deep in": lambda r: (TaskFilter("failed"), ["failed"], deep(r)),
        "status=expired&endpoint, deep": lambda r: (
            TaskFilter("expired", r.choice(ENDPOINTS)), ["expired"], deep(r)),
    }


def _p99(sorted_ms: list[float]) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * 0.99))]


def _epoch_ms(dt: datetime) -> int:
    return (dt - datetime(1970, 1, 1)) // timedelta(milliseconds=1)


async def measure(url: str, sample: list[str], runs: int) -> None:
    engine = make_engine(url)
    r = random.Random(11)
    # Wall time is what an operator waits; CPU time (this process, the driver's thread
    # included) is the same on an idle machine and a loaded one, so it says what the query
    # costs where the wall time says how busy the machine was.
    print(f"{'search':36} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'CPU p99':>8} {'rows':>6}")
    try:
        for name, make in kinds(sample).items():
            times, cpu, found = [], [], 0
            for _ in range(runs):
                f, statuses, after = make(r)
                started, used = time.perf_counter(), time.process_time()
                rows = await from_sql(engine, statuses, f, 50, after)
                times.append((time.perf_counter() - started) * 1000)
                cpu.append((time.process_time() - used) * 1000)
                found += len(rows)
            times.sort()
            cpu.sort()
            print(f"{name:36} {statistics.median(times):8.2f} {_p99(times):8.2f} "
                  f"{times[-1]:8.2f} {_p99(cpu):8.2f} {found // runs:6d}")
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "search.db"
        url = f"sqlite+aiosqlite:///{path}"
        migrate.upgrade(url)
        started = time.monotonic()
        sample = load(path, args.rows)
        print(f"{args.rows:,} rows loaded in {time.monotonic() - started:.1f} s "
              f"({path.stat().st_size / 1e6:.0f} MB); {args.runs} searches of each kind, "
              "a page of 50")
        asyncio.run(measure(url, sample, args.runs))


if __name__ == "__main__":
    main()
