"""The janitor on 1,000,000 task_results rows in MariaDB: rows purged per second, statements,
the longest single DELETE (until its commit, i.e. how long it held its row locks), and what a
concurrent writer (insert a row + update a recent one, as the outbox writer does) sees while
the purge runs, against the same writer with no purge, in the same run. Bounded, loopback only:
a private MariaDB in a temp dir (tests/servers.py), about two minutes on two cores.

    .venv/bin/python bench/purge.py [--rows N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app import migrate
from app.db import make_engine
from app.lifecycle.janitor import Janitor, PurgeStats
from tests.servers import MariaDB

RETENTION_S = 3 * 86400
SPAN_S = 3 * RETENTION_S  # rows spread evenly over 9 days: 2/3 are past retention
CHUNK = 100_000
WRITER_S = 5.0


def load(server: MariaDB, rows: int) -> float:
    """Fill the table with time-ordered ids (like uuid7) through MariaDB's sequence engine:
    INSERT ... SELECT of 100,000 rows a statement."""
    started = time.monotonic()
    for first in range(0, rows, CHUNK):
        n = min(CHUNK, rows - first)
        server.execute(
            "USE qgw",
            "INSERT INTO task_results (task_id, user_id, endpoint, type, status, result, "
            "result_status_code, attempts, created_at, started_at, ended_at) "
            f"SELECT CONCAT(LPAD(HEX({first} + seq), 32, '0'), '.bench'), seq % 1000, 'bench', "
            "'offline', 'completed', REPEAT('r', 120), 200, 1, "
            f"t, t + INTERVAL 1 SECOND, t + INTERVAL 2 SECOND FROM (SELECT seq, "
            f"NOW(3) - INTERVAL {SPAN_S} SECOND + INTERVAL (({first} + seq) * {SPAN_S} / {rows}) "
            f"SECOND AS t FROM seq_1_to_{n}) s",
        )
    return time.monotonic() - started


async def writer(engine: AsyncEngine, stop: asyncio.Event, tag: str) -> list[float]:
    """Latencies (s) of insert-new-row + update-recent-row transactions until `stop`."""
    latencies, i = [], 0
    while not stop.is_set():
        i += 1
        t0 = time.monotonic()
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO task_results (task_id, user_id, endpoint, type, status, attempts, "
                "created_at) VALUES (:id, 1, 'bench', 'offline', 'completed', 1, NOW(3))"),
                {"id": f"{tag}{i:020d}.bench"})
            await conn.execute(text(
                "UPDATE task_results SET attempts = attempts + 1 WHERE task_id = :id"),
                {"id": f"{tag}{i:020d}.bench"})
        latencies.append(time.monotonic() - t0)
    return latencies


async def timed_writer(engine: AsyncEngine, seconds: float, tag: str) -> list[float]:
    stop = asyncio.Event()
    task = asyncio.create_task(writer(engine, stop, tag))
    await asyncio.sleep(seconds)
    stop.set()
    return await task


async def purge_with_writer(url: str) -> tuple[PurgeStats, list[float]]:
    purge_engine, write_engine = make_engine(url), make_engine(url)
    try:
        stop = asyncio.Event()
        w = asyncio.create_task(writer(write_engine, stop, "p"))
        stats = await Janitor(purge_engine, RETENTION_S, 1000).purge()
        stop.set()
        return stats, await w
    finally:
        await purge_engine.dispose()
        await write_engine.dispose()


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 100 else max(xs)


async def run(server: MariaDB, url: str, rows: int) -> None:
    load_s = await asyncio.to_thread(load, server, rows)
    engine = make_engine(url)
    try:
        idle = await timed_writer(engine, WRITER_S, "i")
    finally:
        await engine.dispose()
    stats, busy = await purge_with_writer(url)

    def ms(x: float) -> str:
        return f"{x * 1000:8.1f} ms"

    table = [
        ("rows loaded", f"{rows:,} in {load_s:.1f} s"),
        ("rows purged (past retention)", f"{stats.rows:,}"),
        ("purge wall time", f"{stats.elapsed_s:.1f} s"),
        ("rows purged / s", f"{stats.rows / stats.elapsed_s:,.0f}"),
        ("statements (SELECT keys + DELETE)", f"{stats.statements:,} "
                                              f"({len(stats.batches):,} batches <= 1000)"),
        ("longest single DELETE incl. commit", ms(stats.longest_delete_s)),
        ("writer txns: no purge / during purge", f"{len(idle):,} / {len(busy):,}"),
        ("writer p50: no purge / during", f"{ms(statistics.median(idle))} / "
                                          f"{ms(statistics.median(busy))}"),
        ("writer p99: no purge / during", f"{ms(p99(idle))} / {ms(p99(busy))}"),
        ("writer max: no purge / during", f"{ms(max(idle))} / {ms(max(busy))}"),
        ("writer max ratio (during / no purge)", f"{max(busy) / max(idle):.2f}x"),
    ]
    width = max(len(k) for k, _ in table)
    print(f"janitor purge on MariaDB, retention {RETENTION_S // 86400} d, batch 1000")
    for k, v in table:
        print(f"  {k:<{width}}  {v}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgw-purge-") as tmp:
        server = MariaDB(Path(tmp))
        server.start()
        try:
            url = server.create_database("qgw")
            migrate.upgrade(url)
            asyncio.run(run(server, url, args.rows))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
