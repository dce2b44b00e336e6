"""Replicated Redis on loopback for the failover tests: Sentinel (a master, a replica, three
sentinels) and Cluster (three masters with a replica each), from the binary the other tests use."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from app.embedded import server_binary
from tests.servers import AHEAD, free_port, stop, wait_port


class SentinelSetup:
    """A master, a replica and three sentinels (quorum 2) on loopback, from the binary the
    other tests use, tuned to fail over within a few seconds of the master's death."""

    SERVICE = "qgw"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = os.environ.get("QGW_TEST_REDIS_BIN") or server_binary()
        self.ports = {"master": free_port(), "replica": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def _spawn(self, name: str, port: int, *args: str) -> None:
        proc = subprocess.Popen([*AHEAD, self.binary, *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs[name] = proc
        wait_port(port, proc=proc)

    def _server(self, name: str, *extra: str) -> None:
        port, data = self.ports[name], self.root / name
        data.mkdir(parents=True, exist_ok=True)
        self._spawn(name, port, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                    "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                    "--loglevel", "warning", *extra)

    def start(self) -> None:
        self._server("master")
        self._server("replica", "--replicaof", "127.0.0.1", str(self.ports["master"]))
        for i, port in enumerate(self.sentinel_ports):
            conf = self.root / f"sentinel{i}.conf"  # sentinels rewrite their config file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.ports['master']} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 5000\n")
            self._spawn(f"sentinel{i}", port, str(conf), "--sentinel", "--loglevel", "warning")
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20) -> None:
        """Until the replica is in sync and every sentinel knows it and the two others: a
        failover before that would have nothing to promote."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.ports["replica"], decode_responses=True) as r:
                    synced = r.info("replication")["master_link_status"] == "up"
                states = []
                for port in self.sentinel_ports:
                    with redis.Redis(port=port, decode_responses=True) as s:
                        states.append(s.sentinel_master(self.SERVICE))
                if synced and all(int(m["num-slaves"]) >= 1 and
                                  int(m["num-other-sentinels"]) >= 2 for m in states):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the Sentinel setup did not come up")

    def kill(self, name: str) -> None:
        """kill -9: no shutdown, nothing flushed, as a crashed host."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def revive_old_master(self, timeout: float = 20) -> float:
        """Once the sentinels have promoted the replica (returns the seconds that took), start
        the dead master again, empty, as a replica of the new one (the sentinels would make it
        one too, but only at their next look, up to 10 s later). Not before the promotion:
        back as a master in time, the sentinels would keep it, empty, as the master."""
        deadline, started = time.monotonic() + timeout, time.monotonic()
        while (new := self.master_port()) == self.ports["master"]:
            if time.monotonic() > deadline:
                raise TimeoutError("no failover")
            time.sleep(0.05)
        promoted = time.monotonic() - started
        self._server("master", "--replicaof", "127.0.0.1", str(new))
        return promoted

    def master_port(self) -> int:
        """The master's port as a majority of the sentinels names it now."""
        import redis

        named: list[int] = []
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=0.5) as s:
                    _, master_port = s.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
                    named.append(int(master_port))
            except redis.RedisError:
                continue
        for port in set(named):
            if named.count(port) >= 2:
                return port
        return self.ports["master"]

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)


class ClusterSetup:
    """Redis Cluster on loopback: three masters (slots split evenly), one replica each, from
    the binary the other tests use, tuned to fail over within a few seconds of a master's
    death. Nodes are node0..node5; node0-2 start as masters, node3-5 as their replicas."""

    SLOTS = ((0, 5460), (5461, 10922), (10923, 16383))

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = os.environ.get("QGW_TEST_REDIS_BIN") or server_binary()
        self.ports = {f"node{i}": free_port() for i in range(6)}
        # The bus port is picked too: the default, port + 10000, may be taken or past 65535.
        self.bus_ports = {name: free_port() for name in self.ports}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ids: dict[str, str] = {}
        self.killed: dict[str, tuple[float, str]] = {}  # name -> (when, the replica to succeed)

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.ports[f"node{i}"]) for i in range(3)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.seeds)

    def _spawn(self, name: str) -> None:
        port, data = self.ports[name], self.root / name
        data.mkdir(parents=True, exist_ok=True)
        # Validity factor 0: a replica may take over however long its link has been down.
        proc = subprocess.Popen(
            [*AHEAD, self.binary, "--cluster-enabled", "yes", "--cluster-config-file",
             str(data / "nodes.conf"), "--cluster-node-timeout", "1000",
             "--cluster-replica-validity-factor", "0", "--cluster-port", str(self.bus_ports[name]),
             "--repl-diskless-sync-delay", "0", "--appendonly", "no", "--save", "",
             "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
             "--loglevel", "warning", "--logfile", str(data / "server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs[name] = proc
        wait_port(port, proc=proc)

    def _cmd(self, name: str, *args: str | int) -> Any:
        import redis

        with redis.Redis(port=self.ports[name], decode_responses=True, socket_timeout=2) as r:
            return r.execute_command(*args)

    def start(self) -> None:
        for i, name in enumerate(self.ports):
            self._spawn(name)
            self.ids[name] = self._cmd(name, "CLUSTER", "MYID")
            # Distinct epochs before the nodes meet, as `valkey-cli --cluster create` sets them.
            self._cmd(name, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for i, (low, high) in enumerate(self.SLOTS):
            self._cmd(f"node{i}", "CLUSTER", "ADDSLOTSRANGE", low, high)
        for name in list(self.ports)[1:]:
            self._cmd("node0", "CLUSTER", "MEET", "127.0.0.1", self.ports[name],
                      self.bus_ports[name])
        self._until(self._unmet, "the six nodes did not meet")
        for i in range(3):  # a replica must know its master before it is told to follow it
            self._cmd(f"node{i + 3}", "CLUSTER", "REPLICATE", self.ids[f"node{i}"])
        self._until(self._unsettled, "the cluster did not come up")

    def _view(self, name: str) -> dict[str, tuple[str, str, tuple[str, ...]]]:
        """CLUSTER NODES as `name` sees it: node id -> (flags, master id, slots)."""
        view = {}
        for line in self._cmd(name, "CLUSTER", "NODES").splitlines():
            node_id, _, flags, master, *fields = line.split()
            view[node_id] = (flags.replace("myself,", ""), master, tuple(fields[4:]))
        return view

    def _live(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is None]

    def _unmet(self) -> str | None:
        for name in self.ports:
            flags = [f for f, _, _ in self._view(name).values() if "handshake" not in f]
            if len(flags) < 6:
                return f"{name} knows {len(flags)} nodes"
        return None

    def _unsettled(self) -> str | None:
        """Why the live nodes are not yet one healthy cluster, or None: each says
        cluster_state:ok, all describe the live nodes alike, no slot is left to a dead node,
        three live masters hold all slots, and every live replica is in sync."""
        live, views = self._live(), {}
        live_ids = {self.ids[name] for name in live}
        for name in live:
            info = dict(line.split(":", 1) for line in
                        self._cmd(name, "CLUSTER", "INFO").split() if ":" in line)
            if info["cluster_state"] != "ok" or info["cluster_known_nodes"] != "6":
                return f"{name}: cluster_state {info['cluster_state']}, " \
                       f"{info['cluster_known_nodes']} nodes known"
            view = self._view(name)
            if any(slots for node_id, (_, _, slots) in view.items() if node_id not in live_ids):
                return f"{name} still gives slots to a dead node"
            views[name] = {i: v for i, v in view.items() if i in live_ids}
            role = self._cmd(name, "INFO", "replication")  # parsed by redis-py: a dict
            if role["role"] == "slave" and role["master_link_status"] != "up":
                return f"{name}: replica not in sync"
        first = views[live[0]]
        for name, view in views.items():
            if view != first:
                return f"{name} and {live[0]} do not describe the cluster alike yet"
        if sum(1 for f, _, slots in first.values() if "master" in f and slots) != 3:
            return f"{live[0]} does not see three live masters with slots"
        if sum(1 for f, _, _ in first.values() if "slave" in f) != len(live) - 3:
            return f"{live[0]} does not see every other live node as a replica"
        return None

    def _until(self, unready: Callable[[], str | None], what: str, timeout: float = 30) -> float:
        import redis

        started = time.monotonic()
        why: str | None = "not checked"
        while time.monotonic() < started + timeout:
            try:
                if (why := unready()) is None:
                    return time.monotonic() - started
            except (redis.RedisError, OSError) as exc:
                why = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"{what} within {timeout:.0f} s: {why} (logs: {self.root}/node*/)")

    def master_for(self, key: str) -> str:
        """The node that holds `key`'s slot now, as a live node sees it."""
        return self.master_for_slot(key_slot(key.encode()))

    def replica_of(self, name: str) -> str:
        """The replica of the master `name`, as that master sees it."""
        names = {v: k for k, v in self.ids.items()}
        return next(names[i] for i, (_, master, _) in self._view(name).items()
                    if master == self.ids[name])

    def kill_master(self, name: str) -> None:
        """kill -9 a master: no shutdown, nothing flushed, as a crashed host."""
        heir = self.replica_of(name)
        proc = self.procs[name]
        proc.kill()
        proc.wait()
        self.killed[name] = (time.monotonic(), heir)

    def wait_promoted(self, name: str, timeout: float = 20) -> float:
        """Until the dead master's replica is master and the cluster is whole again; returns
        the seconds since the kill."""
        killed_at, heir = self.killed[name]

        def unready() -> str | None:
            if self._cmd(heir, "INFO", "replication")["role"] != "master":
                return f"{heir} is not master yet"
            return self._unsettled()

        self._until(unready, f"{heir} did not take over from {name}", timeout)
        return time.monotonic() - killed_at

    def restart(self, name: str) -> None:
        """Start a killed node again (after wait_promoted: back before that, it would keep its
        slots, empty); it rejoins as the replica of the node that took its place."""
        self._spawn(name)
        self.killed.pop(name, None)

        def unready() -> str | None:
            if self._cmd(name, "INFO", "replication")["role"] != "slave":
                return f"{name} is not a replica yet"
            return self._unsettled()

        self._until(unready, f"{name} did not rejoin")

    def kill_all(self) -> None:
        """kill -9 every node: the whole Cluster gone (a rack's power cut)."""
        for proc in self.procs.values():
            proc.kill()
            proc.wait()

    def start_all(self) -> None:
        """Every node started again from its nodes.conf (empty: they persist nothing), until
        the Cluster is whole."""
        for name in self.ports:
            self._spawn(name)
        self._until(self._unsettled, "the Cluster did not come back whole")

    def move_slot(self, slot: int, to: str) -> None:
        """Reshard one slot, keys and all, to master `to` while clients run (as
        `valkey-cli --cluster reshard` does: IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE)."""
        source = self.master_for_slot(slot)
        src_id, dst_id = self.ids[source], self.ids[to]
        self._cmd(to, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        self._cmd(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := self._cmd(source, "CLUSTER", "GETKEYSINSLOT", slot, 100):
            self._cmd(source, "MIGRATE", "127.0.0.1", self.ports[to], "", 0, 5000, "KEYS",
                      *keys)
        for name in (to, source, *[n for n in self._live() if n not in (to, source)]):
            if "master" in self._view(name)[self.ids[name]][0]:
                self._cmd(name, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self._until(self._unsettled, f"slot {slot} did not settle on {to}")

    def master_for_slot(self, slot: int) -> str:
        """The master holding `slot` now, as a live node sees it."""
        names = {v: k for k, v in self.ids.items()}
        for node_id, (flags, _, slots) in self._view(self._live()[0]).items():
            for part in slots:
                if part.startswith("["):
                    continue  # a slot being imported or migrated, not held
                low, _, high = part.partition("-")
                if "master" in flags and int(low) <= slot <= int(high or low):
                    return names[node_id]
        raise LookupError(f"no master holds slot {slot}")

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)
