"""Fixtures: a real Redis per session, a fresh key prefix and SQLite file per test, the gateway
app in-process (httpx over ASGI), dispatchers in-process or as `qgw dispatcher` processes."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import migrate
from app.main import create_app
from app.mock_upstream import CONTROL_HEADERS
from app.runtime import Runtime
from app.settings import Settings
from app.startup import start_runtime
from tests import warm
from tests.servers import (
    QGW,
    TLS,
    MariaDB,
    RedisServer,
    SeaweedFS,
    free_port,
    mock_upstream,
    stop,
    wait_port,
)
from tests.topologies import ClusterSetup

ADMIN = "test-admin-token"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # Never restarted: no append-only file, whose writes (every result of every test, and
    # its rewrites) only held up other tests' commits behind them on the disk.
    server = RedisServer(tmp_path_factory.mktemp("redis"), durable=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSetup]:
    """One Redis Cluster (3 masters, 3 replicas) for the session, started on first use."""
    cluster = ClusterSetup(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[ClusterSetup]:
    """A Cluster of the test's own, for tests that kill its nodes."""
    cluster = ClusterSetup(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDB]:
    """One MariaDB for the session (started on first use); tests take a fresh database each."""
    server = MariaDB(tmp_path_factory.mktemp("mariadb"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One S3 server for the session (started on first use, ~10 s); tests take a bucket each."""
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["file", "s3"])
def store_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test's result store kind, run once each: "file", or "s3" with the session's
    SeaweedFS in the AWS_* variables (of this process, and so of those it starts)."""
    if request.param == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
    return str(request.param)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own, for tests that stop and start it again (append-only file
    on: a restart keeps its data)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


_RAM = Path("/dev/shm")
_RAM_NEEDED = 8 << 30  # the largest test writes ~1 GB there; a container's 64 MB would not do


def _ram_free() -> int:
    try:
        st = os.statvfs(_RAM)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize if os.access(_RAM, os.W_OK) else 0


@pytest.fixture
def sqlite_file(tmp_path: Path) -> Iterator[Path]:
    """Where a test's SQLite database lives: in memory (tmpfs) where the machine has one, so
    that its commits never wait on the disk: other tests write gigabytes there (large results,
    Redis, MariaDB, S3), and a commit's fsync behind them took up to 0.6 s. Removed with the
    test."""
    if _ram_free() < _RAM_NEEDED:
        yield tmp_path / "qgw.db"
        return
    folder = Path(tempfile.mkdtemp(prefix="qgw-test-", dir=_RAM))
    try:
        yield folder / "qgw.db"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "mariadb"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The storage suite runs once per database: a fresh SQLite file, or a fresh MariaDB
    database on the session server."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{request.getfixturevalue('sqlite_file')}"
    server: MariaDB = request.getfixturevalue("mariadb")
    return server.create_database(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[str]:
    with mock_upstream() as base:
        yield base


@pytest.fixture
def upstream(upstream_server: str) -> str:
    """The session's mock upstream, its log emptied for each test: tests use their own paths,
    and a test that runs once per backend finds only its own calls."""
    httpx.post(f"{upstream_server}/_mock/reset", verify=TLS).raise_for_status()
    return upstream_server


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`@pytest.mark.backends("single", "cluster")` (on a test or a module): the test runs once
    per Redis kind, like SAQ runs one suite over its backends."""
    marker = metafunc.definition.get_closest_marker("backends")
    if marker and "redis_url" in metafunc.fixturenames:  # tests of their own Redis stay as they are
        metafunc.parametrize("backend", marker.args, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The Redis kind a test runs on: one Redis unless the test is marked `backends`
    (QGW_TEST_BACKEND=cluster runs every other test on the Cluster instead)."""
    return str(getattr(request, "param", os.environ.get("QGW_TEST_BACKEND", "single")))


@pytest.fixture
def redis_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The session's single Redis, or its Cluster (QGW_TEST_CLUSTER_URL names another one)."""
    if backend == "cluster":
        url = os.environ.get("QGW_TEST_CLUSTER_URL")
        return url or str(request.getfixturevalue("redis_cluster").url)
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
def settings(redis_url: str, tmp_path: Path, sqlite_file: Path) -> Settings:
    return Settings(
        redis_url=redis_url, database_url=f"sqlite+aiosqlite:///{sqlite_file}",
        data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
        permit_secret="test-permit-secret", lease_ms=3000, reap_interval_ms=200,
        # A 2-core host running the whole suite stalls a process for seconds at times: the
        # product's 3 s bound failed a first admin write with a 503 now and then (SQLite and
        # MariaDB alike). The tests of that bound set it back (SQL_REQUEST_TIMEOUT_S).
        sql_timeout_s=10,
    )


@pytest.fixture
def env(settings: Settings) -> dict[str, str]:
    """The environment a `qgw` process needs to join this test's gateway."""
    return {**os.environ, "QGW_REDIS_URL": settings.redis_url or "",
            "QGW_DATABASE_URL": settings.db_url, "QGW_KEY_PREFIX": settings.key_prefix,
            "QGW_DATA_DIR": str(settings.data_dir), "QGW_ADMIN_TOKEN": ADMIN,
            "QGW_PERMIT_SECRET": "test-permit-secret", "QGW_LEASE_MS": str(settings.lease_ms),
            "QGW_SQL_TIMEOUT_S": str(settings.sql_timeout_s),
            "QGW_REAP_INTERVAL_MS": str(settings.reap_interval_ms),
            "QGW_RESULT_STORE": settings.result_store_url,
            "QGW_MAX_RESULT_BYTES": str(settings.max_result_bytes),
            "QGW_RESULT_INLINE_BYTES": str(settings.result_inline_bytes)}


class Gateway:
    """The app in-process, with helpers that speak its HTTP API."""

    def __init__(self, runtime: Runtime, client: httpx.AsyncClient) -> None:
        self.rt, self.http = runtime, client
        self.admin = {"Authorization": f"Bearer {ADMIN}"}

    async def add_endpoint(self, endpoint_id: str, target_url: str, **fields: Any) -> None:
        """Register an endpoint; unless told otherwise its tasks may steer the mock upstream."""
        fields.setdefault("forward_headers", list(CONTROL_HEADERS))
        r = await self.http.post("/admin/v1/endpoints", headers=self.admin,
                                 json={"id": endpoint_id, "target_url": target_url, **fields})
        assert r.status_code == 201, r.text

    async def new_key(self, user_id: int = 1, max_priority: int = 10) -> dict[str, str]:
        r = await self.http.post("/admin/v1/api-keys", headers=self.admin,
                                 json={"user_id": user_id, "max_priority": max_priority})
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['key']}"}

    async def submit(self, auth: dict[str, str], target_url: str, **fields: Any) -> dict[str, Any]:
        r = await self.http.post("/api/v1/tasks", headers=auth,
                                 json={"target_url": target_url, **fields})
        assert r.status_code == 202, r.text
        body: dict[str, Any] = r.json()
        return body

    async def status(self, auth: dict[str, str], task_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/api/v1/tasks/{task_id}", headers=auth)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def wait_finished(
        self, auth: dict[str, str], task_ids: list[str], timeout: float = 30
    ) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = set(task_ids)
        done: dict[str, dict[str, Any]] = {}
        while pending:
            for tid in list(pending):
                s = await self.status(auth, tid)
                if s["task_status"] not in ("pending", "processing"):
                    done[tid] = s
                    pending.discard(tid)
            if pending:
                assert loop.time() < deadline, f"{len(pending)} tasks still unfinished"
                await asyncio.sleep(0.1)
        return [done[t] for t in task_ids]


_SQLITE = "sqlite+aiosqlite:///"
_template: list[Path] = []  # this worker's SQLite database at the head revision, made once


async def _migrated(settings: Settings) -> None:
    await asyncio.to_thread(_migrate, settings.db_url)


def _migrate(url: str) -> None:
    """The test's database at the head revision: a fresh SQLite file is a copy of one migrated
    once a worker (migrating takes a tenth of a second; hundreds of tests pay it otherwise),
    any other database is migrated."""
    target = Path(url.removeprefix(_SQLITE))
    if not url.startswith(_SQLITE) or target.exists():
        migrate.upgrade(url)
        return
    if not _template:
        where = tempfile.mkdtemp(prefix="qgw-template-")
        atexit.register(shutil.rmtree, where, True)
        made = Path(where) / "qgw.db"
        migrate.upgrade(_SQLITE + str(made))
        _template.append(made)
    shutil.copyfile(_template[0], target)


async def _started(settings: Settings, with_dispatcher: bool, give_up_s: float = 15) -> Runtime:
    """A runtime started as `qgw` starts one: a Redis that does not answer in time (a node
    starved of CPU for a second on a loaded 2-core host) is retried, not a failed test; one
    that never answers fails the test after `give_up_s`."""
    give_up = asyncio.Event()
    timer = asyncio.get_running_loop().call_later(give_up_s, give_up.set)
    try:
        rt = await start_runtime(settings, with_dispatcher, give_up)
    finally:
        timer.cancel()
    assert rt is not None, f"Redis did not answer for {give_up_s:g} s"
    return rt


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[Gateway]:
    """The API without a dispatcher: tasks stay queued until a test starts one."""
    await _migrated(settings)
    rt = await _started(settings, with_dispatcher=False)
    app = create_app(rt, manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                 base_url="http://gateway") as client:
        yield Gateway(rt, client)
    await rt.stop()


@pytest.fixture
async def start_dispatcher(settings: Settings) -> AsyncIterator[Callable[[], Awaitable[Runtime]]]:
    """Start an in-process dispatcher (as many as called); all stop at the end of the test."""
    started: list[Runtime] = []

    async def start() -> Runtime:
        rt = await _started(settings, with_dispatcher=True)
        started.append(rt)
        return rt

    yield start
    stopped = await asyncio.gather(*(rt.stop(grace_s=1) for rt in started),
                                   return_exceptions=True)  # each stops whatever the others do
    for outcome in stopped:
        if isinstance(outcome, BaseException):
            raise outcome


@pytest.fixture
def dispatcher_process(env: dict[str, str]) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `qgw dispatcher` processes; all are stopped at the end of the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(**extra_env: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([*QGW, "dispatcher"], env={**env, **extra_env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    yield start
    stop(*procs, timeout=2)  # no grace at the end (10 s by default): the test is over


@pytest.fixture
def fresh_upstream() -> Iterator[str]:
    with mock_upstream() as base:
        yield base


#: Modules with the longest tests (15-36 s each, 2-core machine, 3 workers): run first, so
#: that no worker is left in one of them while the others have run out of work (pytest-xdist
#: hands tests out in collection order, which is alphabetical, test_starvation near the end).
SLOW_FIRST = frozenset({"test_starvation", "test_outbox", "test_package", "test_large_reads",
                        "test_cluster_failover", "test_sentinel", "test_admin_outages",
                        "test_limits", "test_adaptive"})


def pytest_sessionstart(session: pytest.Session) -> None:
    """`qgw` commands start warm (tests/warm.py: a third of the suite's CPU was their
    imports); QGW_TEST_COLD=1 starts each as a new interpreter, as before."""
    # Not in pytest-xdist's controller, which runs no test: only in its workers, or alone.
    controller = not hasattr(session.config, "workerinput") and getattr(
        session.config.option, "numprocesses", None)
    if not os.environ.get("QGW_TEST_COLD") and not controller:
        warm.install()


def pytest_sessionfinish(session: pytest.Session) -> None:
    warm.uninstall()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOW_FIRST's tests ahead, each module's order kept (a stable sort): every worker
    collects the same order."""
    items.sort(key=lambda item: item.path.stem not in SLOW_FIRST)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A skipped test fails: `make test` installs everything the suite needs
    (scripts/system-deps), so a skip could only hide a test that never ran."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, and the suite skips nothing: {report.longrepr}"
    return report


@pytest.fixture
def start_api(
    gateway: Gateway, env: dict[str, str]
) -> Iterator[Callable[[], Awaitable[str]]]:
    """Start `qgw api` processes beside the in-process gateway (same Redis, database and
    prefix; set endpoints up first, or wait a second for them to spread); returns the base
    URL. For clients that need a real server: streams, retries over real sockets."""
    procs: list[subprocess.Popen[bytes]] = []

    async def start() -> str:
        port = free_port()
        proc = subprocess.Popen([*QGW, "api", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        await asyncio.to_thread(wait_port, port, 30.0, proc)
        return f"http://127.0.0.1:{port}"

    yield start
    stop(*procs, timeout=1)  # a second's grace at the end, not its 5 s: the test is over
