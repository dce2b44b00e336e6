"""A failover under load, counted: `qgw serve` on a Sentinel or a Cluster URL, submits running
and calls reaching the mock upstream, the master (on a Cluster, the one holding the load's
queue) killed with -9, its replica promoted, the dead node started again as a replica.

With `keyed`, every submit carries an Idempotency-Key and the caller a daily quota (the two-step
submit of a Cluster), each refused submit is sent again with its key once the failover is over,
and on a Cluster the master killed may be the one holding the caller's keys instead.

Shared by tests/test_sentinel.py, tests/test_cluster_failover.py (asserts) and
bench/failover.py (prints the figures).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from app.core.keys import Keys
from tests.servers import QGW, free_port, mock_log, mock_upstream, stop, wait_port
from tests.topologies import ClusterSetup, SentinelSetup

Kind = Literal["sentinel", "cluster"]
Victim = Literal["queue", "user"]  # on a Cluster: the master of the load's queue, or the caller's

ADMIN = "failover-admin-token"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
ENDPOINT = "fo"  # the endpoint the load goes to


@dataclass
class Figures:
    wait_replicas: int
    kind: Kind = "sentinel"
    acknowledged: int = 0  # submits answered 202
    refused: int = 0  # answered otherwise (503) or not at all, while the master was away
    completed: int = 0  # acknowledged and then completed
    other_terminal: int = 0  # acknowledged and then failed / expired / cancelled
    unfinished: int = 0  # acknowledged, still pending or processing at the deadline
    lost: int = 0  # acknowledged, then unknown to the gateway (404) after the failover
    duplicates: int = 0  # tasks the upstream received more than once
    refused_ran: int = 0  # tasks answered 503 (queued, not confirmed) that ran all the same
    promoted_s: float = 0.0  # kill -9 to the new master named (by a majority of sentinels, or
    # by every node of the Cluster)
    recover_s: float = 0.0  # kill -9 to the first 202 on a submit sent after it
    calls_resumed_s: float = 0.0  # kill -9 to the first upstream call of a task acked after it
    gateway_restarted: bool = False
    resent: int = 0  # keyed: refused submits sent again with their key after the failover
    split_keys: int = 0  # keyed: Idempotency-Keys that made more than one task (must be 0)
    errors: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        return (f"{self.kind}, WAIT {self.wait_replicas}: acknowledged {self.acknowledged}, "
                f"completed {self.completed}, other terminal {self.other_terminal}, unfinished "
                f"{self.unfinished}, lost {self.lost}, duplicates {self.duplicates}, refused "
                f"{self.refused} (of which ran {self.refused_ran}); promoted after "
                f"{self.promoted_s:.2f} s, submits back after {self.recover_s:.2f} s, calls "
                f"after {self.calls_resumed_s:.2f} s"
                + (f"; resent {self.resent} by key, {self.split_keys} keys made two tasks"
                   if self.resent or self.split_keys else ""))


def gateway_env(root: Path, url: str, port: int, wait_replicas: int) -> dict[str, str]:
    return {**os.environ, "QGW_REDIS_URL": url, "QGW_DATA_DIR": str(root),
            "QGW_DATABASE_URL": f"sqlite+aiosqlite:///{root}/qgw.db", "QGW_PORT": str(port),
            "QGW_ADMIN_TOKEN": ADMIN, "QGW_PERMIT_SECRET": "failover-permit-secret",
            "QGW_LEASE_MS": "3000", "QGW_REAP_INTERVAL_MS": "200", "QGW_LOG_LEVEL": "warning",
            "QGW_REDIS_WAIT_REPLICAS": str(wait_replicas)}


class Load:
    """Submitters that keep going through the failover; every answer is kept."""

    def __init__(self, http: httpx.AsyncClient, auth: dict[str, str], target: str,
                 keyed: bool = False) -> None:
        self.http, self.auth, self.target, self.keyed = http, auth, target, keyed
        self.acked: list[tuple[float, str]] = []  # (sent at, task id)
        self.refused: Counter[str] = Counter()
        self.unanswered: list[str] = []  # keyed: the bodies (and keys) of refused submits
        self.tasks_of: dict[str, set[str]] = {}  # keyed: key -> the task ids it was answered
        self.running = True

    async def submit(self, body: str) -> bool:
        """One submit; True once answered 202."""
        headers = {**self.auth, "Idempotency-Key": body} if self.keyed else self.auth
        sent = time.monotonic()
        try:
            r = await self.http.post("/api/v1/tasks", headers=headers, json={
                "target_url": self.target, "body": body})
        except httpx.HTTPError as exc:
            self.refused[type(exc).__name__] += 1
            return False
        if r.status_code == 202:
            self.acked.append((sent, r.json()["task_id"]))
            self.tasks_of.setdefault(body, set()).add(r.json()["task_id"])
            return True
        code = r.json()["error"]["code"] if r.status_code != 500 else "server error"
        self.refused[f"{r.status_code} {code}"] += 1  # a 500 has no JSON body
        return False

    async def submitter(self, n: int) -> None:
        i = 0
        while self.running:
            i += 1
            if not await self.submit(f"{n}-{i}"):
                self.unanswered.append(f"{n}-{i}")
                await asyncio.sleep(0.05)

    async def resend(self) -> int:
        """Each refused submit again with its key, as a client told 503 would: it makes the
        task if the first never queued it, or answers the task it did queue."""
        for body in self.unanswered:
            for _ in range(20):
                if await self.submit(body):
                    break
                await asyncio.sleep(0.2)
        return len(self.unanswered)


async def _setup(http: httpx.AsyncClient, target: str, user_id: int = 1,
                 keyed: bool = False) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": ENDPOINT, "target_url": target, "rate": 2000, "interval_ms": 1000,
        "max_concurrency": 32})
    assert r.status_code == 201, r.text
    r = await http.post("/admin/v1/api-keys", headers=admin,
                        json={"user_id": user_id, "max_priority": 10,
                              **({"daily_quota": 1_000_000} if keyed else {})})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def _final_states(http: httpx.AsyncClient, auth: dict[str, str], ids: list[str],
                        stalled_s: float) -> dict[str, str]:
    """Each task's status once terminal or gone (`lost`), or as it is once none has ended
    for `stalled_s`: bounded by progress, not by a total (a fixed 25 s once left 73 tasks
    still finishing on a host the rest of the suite kept busy; stuck tasks make none)."""
    states: dict[str, str] = {}
    pending = list(ids)
    deadline = time.monotonic() + stalled_s
    at_most = time.monotonic() + 6 * stalled_s  # a trickle that never ends still ends it
    sem = asyncio.Semaphore(16)

    async def one(tid: str) -> None:
        async with sem:
            try:
                r = await http.get(f"/api/v1/tasks/{tid}", headers=auth)
            except httpx.HTTPError:
                return
        if r.status_code == 404:
            states[tid] = "lost"
        elif r.status_code == 200:
            states[tid] = r.json()["task_status"]

    while pending:
        await asyncio.gather(*(one(t) for t in pending))
        left = [t for t in pending if states.get(t) not in TERMINAL | {"lost"}]
        if len(left) < len(pending):
            deadline = time.monotonic() + stalled_s
        pending = left
        if not pending or time.monotonic() > min(deadline, at_most):
            break
        await asyncio.sleep(0.3)
    return states


class _Topology(ABC):
    """What the driver does to the Redis side, whichever it is: a replica made to lag, the
    master's death, and the wait for the promotion (the dead node then started again, as a
    replica)."""

    setup: SentinelSetup | ClusterSetup
    lagged: subprocess.Popen[bytes] | None = None
    user_id = 1  # the load's caller

    def start(self) -> None:
        self.setup.start()

    def stop(self) -> None:
        self.setup.stop()

    @abstractmethod
    def lag(self) -> None: ...

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    def heal(self) -> float:
        """Seconds from the kill to the promotion."""

    def _lag(self, replica: subprocess.Popen[bytes], master_port: int, tag: str) -> None:
        """Stop the replica and write more than the sockets between it and the master hold,
        so what follows stays in the master's memory: a replica lagging behind (a slow link,
        a busy host), the case asynchronous replication loses acknowledged writes in."""
        import redis

        replica.send_signal(signal.SIGSTOP)
        self.lagged = replica
        with redis.Redis(port=master_port) as r:
            filler = b"x" * (1 << 20)
            r.mset({f"filler:{tag}:{i}": filler for i in range(48)})

    def unlag(self) -> None:
        if self.lagged is not None:
            self.lagged.send_signal(signal.SIGCONT)


class _Sentinel(_Topology):
    setup: SentinelSetup

    def __init__(self, root: Path) -> None:
        self.setup = SentinelSetup(root / "redis")

    def lag(self) -> None:
        self._lag(self.setup.procs["replica"], self.setup.ports["master"], "")

    def kill(self) -> None:
        self.setup.kill("master")

    def heal(self) -> float:
        return self.setup.revive_old_master()


class _Cluster(_Topology):
    setup: ClusterSetup

    def __init__(self, root: Path, victim: Victim = "queue") -> None:
        self.setup = ClusterSetup(root / "cluster")
        self.kills, self.victim = victim, ""

    def start(self) -> None:
        super().start()
        # The master of the load's endpoint, as the gateway (default prefix) names its keys.
        keys = Keys("qgw", cluster=True)
        queue_master = self.setup.master_for(keys.queue(ENDPOINT))
        self.victim = queue_master
        if self.kills == "user":  # a caller whose keys live on another master: kill that one
            self.user_id = next(u for u in range(1, 100) if self.setup.master_for(
                keys.idempotency(u, "x")) != queue_master)
            self.victim = self.setup.master_for(keys.idempotency(self.user_id, "x"))

    def lag(self) -> None:
        tag = "{" + Keys("qgw", cluster=True).tag(ENDPOINT).partition("{")[2]  # its slot
        heir = self.setup.replica_of(self.victim)
        self._lag(self.setup.procs[heir], self.setup.ports[self.victim], tag)

    def kill(self) -> None:
        self.setup.kill_master(self.victim)

    def heal(self) -> float:
        promoted = self.setup.wait_promoted(self.victim)
        self.setup.restart(self.victim)
        return promoted


async def _drive(fig: Figures, redis: _Topology, port: int, base: str,
                 before_s: float, after_s: float, lag_s: float, keyed: bool) -> None:
    target = f"{base}/{ENDPOINT}"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        auth = await _setup(http, target, redis.user_id, keyed)
        load = Load(http, auth, target, keyed)
        workers = [asyncio.create_task(load.submitter(n)) for n in range(6)]
        await asyncio.sleep(before_s)
        if lag_s:
            await asyncio.to_thread(redis.lag)
            await asyncio.sleep(lag_s)
        await asyncio.to_thread(redis.kill)
        killed = time.monotonic()
        redis.unlag()
        revived = asyncio.create_task(asyncio.to_thread(redis.heal))
        while time.monotonic() - killed < 20:  # until submits are back, then some more
            back = [s for s, _ in load.acked if s > killed]
            if back and time.monotonic() - min(back) > after_s:
                break
            await asyncio.sleep(0.1)
        load.running = False
        await asyncio.gather(*workers)
        fig.promoted_s = await revived
        after = [s for s, _ in load.acked if s > killed]
        fig.recover_s = min(after) - killed if after else float("inf")
        if keyed:
            fig.resent = await load.resend()
            fig.split_keys = sum(1 for ids in load.tasks_of.values() if len(ids) > 1)
        fig.acknowledged, fig.refused = len(load.acked), sum(load.refused.values())
        fig.errors = load.refused
        states = Counter((await _final_states(http, auth, [t for _, t in load.acked], 20))
                         .values())
    fig.completed, fig.lost = states["completed"], states["lost"]
    fig.other_terminal = sum(states[s] for s in TERMINAL - {"completed"})
    fig.unfinished = states["pending"] + states["processing"]
    late = {t for s, t in load.acked if s > killed}
    log = mock_log(base)
    calls = Counter(str(e["idempotency_key"]) for e in log)
    fig.duplicates = sum(1 for n in calls.values() if n > 1)
    fig.refused_ran = len(set(calls) - {t for _, t in load.acked})
    wall_killed = time.time() - (time.monotonic() - killed)
    resumed = [float(str(e["t"])) / 1000 for e in log if e["idempotency_key"] in late]
    fig.calls_resumed_s = min(resumed) - wall_killed if resumed else float("inf")


def run_failover(root: Path, wait_replicas: int, before_s: float = 2.0,
                 after_s: float = 2.0, lag_s: float = 0.0, kind: Kind = "sentinel",
                 keyed: bool = False, victim: Victim = "queue") -> Figures:
    """One failover under load; the figures of what the clients saw. With `lag_s`, the
    replica lags that long behind the master before it dies."""
    fig = Figures(wait_replicas, kind)
    setup = _Sentinel(root) if kind == "sentinel" else _Cluster(root, victim)
    setup.start()
    try:
        with mock_upstream("--latency-ms", "20") as base:
            port = free_port()
            with open(root / "qgw.log", "wb") as out:
                proc = subprocess.Popen([*QGW, "serve"], stdout=out, stderr=subprocess.STDOUT,
                                        env=gateway_env(root, setup.setup.url, port, wait_replicas))
            try:
                wait_port(port, timeout=30, proc=proc)
                asyncio.run(_drive(fig, setup, port, base, before_s, after_s, lag_s, keyed))
                fig.gateway_restarted = proc.poll() is not None
            finally:
                stop(proc)
    finally:
        setup.stop()
    return fig
