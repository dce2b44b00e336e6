"""Real servers for tests: Redis-compatible, MariaDB and the mock upstream, as processes."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from app.embedded import server_binary

QGW = [sys.executable, "-m", "app"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def read_until(proc: subprocess.Popen[Any], text: str, timeout: float = 30.0) -> list[str]:
    """Lines of `proc`'s stderr (a pipe) up to the first that contains `text`: a process
    starting on a loaded machine is waited for by what it says, not for a fixed time."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line if isinstance(line, str) else line.decode(errors="replace"))
        if text in lines[-1]:
            return lines
    raise TimeoutError(f"{text!r} not seen; the process said: {''.join(lines)[-2000:]}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """Debian's redis-server or the embedded valkey binary (QGW_TEST_REDIS_BIN picks one)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.binary = os.environ.get("QGW_TEST_REDIS_BIN") or server_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.data_dir), "--appendonly", "yes", "--save", "", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc:
            stop(self.proc)


@contextmanager
def mock_upstream(*flags: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([*QGW, "mock-upstream", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def mock_log(base: str) -> list[dict[str, object]]:
    log: list[dict[str, object]] = httpx.get(f"{base}/_mock/log").json()
    return log


class MariaDB:
    """A private MariaDB server in a temp dir, on loopback TCP; root has no password.

    `make test` installs Debian's `mariadb-server`; a missing binary fails the storage tests loudly
    (they are the proof the MySQL path works), it does not skip them."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binaries() -> tuple[str, str]:
        server = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin")
        install = shutil.which("mariadb-install-db")
        if not server or not install:
            raise RuntimeError("mariadbd / mariadb-install-db not found: install the "
                               "mariadb-server package (make test does: scripts/system-deps)")
        return server, install

    def url(self, database: str) -> str:
        return f"mysql+aiomysql://root@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        server, install = self.binaries()
        datadir = self.data_dir / "data"
        if not datadir.exists():
            subprocess.run(
                [install, "--no-defaults", f"--datadir={datadir}", "--user=root",
                 "--auth-root-authentication-method=normal", "--skip-test-db"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Small buffers and no binary log or fsync per commit: a test server, not a durable one.
        self.proc = subprocess.Popen(
            [server, "--no-defaults", f"--datadir={datadir}", "--user=root",
             f"--socket={self.data_dir}/mysqld.sock", f"--port={self.port}",
             "--bind-address=127.0.0.1", "--skip-log-bin", "--innodb-buffer-pool-size=256M",
             "--innodb-flush-log-at-trx-commit=2", "--skip-name-resolve",
             f"--log-error={self.data_dir}/error.log", f"--pid-file={self.data_dir}/mysqld.pid"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout=60, proc=self.proc)

    def execute(self, *statements: str) -> None:
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", password="")
        try:
            with conn.cursor() as cur:
                for sql in statements:
                    cur.execute(sql)
            conn.commit()
        finally:
            conn.close()

    def create_database(self, name: str) -> str:
        self.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        return self.url(name)

    def stop(self) -> None:
        if self.proc:
            stop(self.proc, timeout=30)
            self.proc = None


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
        proc = subprocess.Popen([self.binary, *args], stdout=subprocess.DEVNULL,
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
