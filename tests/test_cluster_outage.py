"""Every node of a Cluster gone at once, then back (empty): the gateway answers 503 with its
JSON error meanwhile, never a 500, and carries on by itself once the Cluster is whole again,
its dispatcher's wake loops included. A URL of the wrong kind for its server is one line at
start; a Cluster not there yet is waited for, as one Redis is."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

import pytest
import redis
from redis.crc import key_slot

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import QGW, RedisServer, free_port
from tests.topologies import ClusterSetup


@pytest.fixture
def settings(own_cluster: ClusterSetup, tmp_path: Path) -> Settings:
    """No reaper pass within the test: the task after the outage starts because a wake loop
    woke for it, not because the reaper nudged it."""
    return Settings(
        redis_url=own_cluster.url, database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db",
        data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
        permit_secret="test-permit-secret", lease_ms=3000, reap_interval_ms=60_000,
    )


async def test_the_whole_cluster_down_and_back(
    gateway: Gateway, own_cluster: ClusterSetup,
    start_dispatcher: Callable[[], Awaitable[Runtime]], upstream: str,
) -> None:
    url = f"{upstream}/whole"
    await gateway.add_endpoint("whole", url)
    auth = await gateway.new_key()
    await start_dispatcher()
    first = (await gateway.submit(auth, url))["task_id"]
    await gateway.wait_finished(auth, [first])

    own_cluster.kill_all()
    for method, path, body in (("POST", "/api/v1/tasks", {"target_url": url}),
                               ("GET", f"/api/v1/tasks/{first}", None)):
        for _ in range(3):  # the first meets dead connections, the next no node at all
            r = await gateway.http.request(method, path, json=body, headers=auth)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "redis_unavailable"
    assert (await gateway.http.get("/readyz")).status_code == 503

    own_cluster.start_all()  # empty: the registry comes back from SQL by itself
    deadline = time.monotonic() + 30
    while (r := await gateway.http.post("/api/v1/tasks", headers=auth,
                                        json={"target_url": url})).status_code != 202:
        assert time.monotonic() < deadline, r.text
    done = await gateway.wait_finished(auth, [r.json()["task_id"]], timeout=10)
    assert done[0]["task_status"] == "completed"


def _start(tmp_path: Path, url: str, stderr: IO[str] | int = subprocess.PIPE
           ) -> subprocess.Popen[str]:
    env = {**os.environ, "QGW_REDIS_URL": url, "QGW_DATA_DIR": str(tmp_path),
           "QGW_PORT": str(free_port()), "QGW_LOG_LEVEL": "warning"}
    return subprocess.Popen([*QGW, "api"], env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr, text=True)


@pytest.mark.parametrize("kind", ["redis:// at a Cluster node", "redis+cluster:// at one Redis"])
def test_a_url_of_the_wrong_kind_stops_start_in_one_line(
    tmp_path: Path, kind: str, redis_cluster: ClusterSetup, redis_server: RedisServer
) -> None:
    if kind.startswith("redis://"):
        host, port = redis_cluster.seeds[0]
        url, says = f"redis://{host}:{port}", "use redis+cluster://"
    else:
        url, says = f"redis+cluster://127.0.0.1:{redis_server.port}", "use redis://"
    proc = _start(tmp_path, url)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert err.count("\n") == 1 and "QGW_REDIS_URL" in err and says in err, err


def test_a_cluster_not_there_yet_is_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        proc = _start(tmp_path, f"redis+cluster://127.0.0.1:{free_port()}", stderr)
    try:
        deadline = time.monotonic() + 30  # start-up takes seconds on a loaded host
        while "cannot reach Redis" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(1)  # and it goes on waiting
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    err = log.read_text()
    waits = [line for line in err.splitlines() if "cannot reach Redis" in line]
    assert waits and "Traceback" not in err, err
    assert all(len(line) < 400 for line in waits), waits


async def test_a_slot_no_master_serves_is_a_503(
    gateway: Gateway, own_cluster: ClusterSetup, upstream: str
) -> None:
    """Between a master's death and its replica's promotion, the slot of an endpoint's keys
    may be served by no one, and redis-py's map of the Cluster then says so: a submit and a
    status read answer 503 redis_unavailable (each once the map has it), never a 500; the
    other endpoints' requests go on."""
    await gateway.add_endpoint("gap", f"{upstream}/gap")
    await gateway.add_endpoint("ok", f"{upstream}/ok")
    auth = await gateway.new_key()
    first = (await gateway.submit(auth, f"{upstream}/gap"))["task_id"]
    keys = gateway.rt.keys
    slot, other = key_slot(keys.queue("gap").encode()), key_slot(keys.queue("ok").encode())
    assert slot != other
    for port in own_cluster.ports.values():  # every node forgets the slot: no one serves it
        with redis.Redis(port=port) as node:
            node.config_set("cluster-require-full-coverage", "no")
            node.execute_command("CLUSTER", "DELSLOTS", slot)
    for method, path, body in (("POST", "/api/v1/tasks", {"target_url": f"{upstream}/gap"}),
                               ("GET", f"/api/v1/tasks/{first}", None)):
        for _ in range(3):  # the first finds the slot gone from its node, then from the map
            r = await gateway.http.request(method, path, json=body, headers=auth)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "redis_unavailable"
    ok = await gateway.http.post("/api/v1/tasks", headers=auth,
                                 json={"target_url": f"{upstream}/ok"})
    assert ok.status_code == 202, ok.text
