"""QGW_REDIS_URL beyond one Redis: Sentinel URLs, a real failover under load, bad URLs refused
at start in one line, and a replica (a demoted master) answering writes with a JSON 503."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from app.redis_url import RedisTarget, parse
from app.settings import Settings
from tests.conftest import Gateway
from tests.failover import run_failover
from tests.servers import QGW, RedisServer, free_port


def test_sentinel_urls_name_sentinels_service_and_db() -> None:
    assert parse("redis+sentinel://a:26380,b/mymaster/2") == RedisTarget(
        "sentinel", "redis+sentinel://a:26380,b/mymaster/2", hosts=(("a", 26380), ("b", 26379)),
        service="mymaster", db=2)
    tls = parse("rediss+sentinel://app:p%40ss@[::1]:5000/m")
    assert (tls.tls, tls.hosts, tls.username, tls.password) == (True, (("::1", 5000),), "app",
                                                               "p@ss")
    # TLS options as redis-py reads them from rediss://, with or without a path before them.
    for url in ("rediss+cluster://h:7000?ssl_ca_certs=/ca%20dir/ca.pem&ssl_cert_reqs=required",
                "rediss+cluster://h:7000/?ssl_ca_certs=/ca%20dir/ca.pem&ssl_cert_reqs=required"):
        assert parse(url).tls_options == (("ssl_ca_certs", "/ca dir/ca.pem"),
                                          ("ssl_cert_reqs", "required"))


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/0", "a Cluster URL has no path"),
    ("redis+sentinel://127.0.0.1:26379", "ends in /<service>"),
    ("redis+sentinel://127.0.0.1:x/m", "bad host:port '127.0.0.1:x'"),
    ("redis://127.0.0.1:6379/zero", "bad database number 'zero'"),
    ("http://127.0.0.1:6379", "must start with one of redis://"),
    ("rediss+cluster://127.0.0.1:7000?ssl_ca=/x", "unknown option 'ssl_ca'"),
    ("redis+sentinel://127.0.0.1/m?ssl_ca_certs=/x", "ssl_ca_certs needs TLS"),
])
def test_a_bad_redis_url_stops_start_in_one_line(tmp_path: Path, url: str, says: str) -> None:
    env = {**os.environ, "QGW_REDIS_URL": url, "QGW_DATA_DIR": str(tmp_path),
           "QGW_PORT": str(free_port())}
    proc = subprocess.run([*QGW, "api"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "QGW_REDIS_URL" in proc.stderr, proc.stderr
    assert says in proc.stderr


class TestReplica:
    """A plain URL naming a replica, as one naming a master a failover demoted."""

    @pytest.fixture
    def settings(self, settings: Settings, own_redis: RedisServer) -> Settings:
        return settings.model_copy(update={"redis_url": own_redis.url})

    async def test_writes_answer_json_503(self, gateway: Gateway, upstream: str) -> None:
        url = f"{upstream}/ro"
        await gateway.add_endpoint("ro", url)
        auth = await gateway.new_key()
        # A replica of a master that does not answer: it keeps its data and refuses writes.
        await gateway.rt.redis.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]  # untyped in redis-py

        submit = await gateway.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
        key = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                      json={"user_id": 2})
        for r in (submit, key):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "redis_unavailable"
            assert r.headers["Retry-After"] == "1"


class TestWaitReplicas:
    @pytest.fixture
    def settings(self, settings: Settings) -> Settings:
        return settings.model_copy(update={"redis_wait_replicas": 1})

    async def test_a_submit_no_replica_confirms_is_not_acknowledged(
        self, gateway: Gateway, upstream: str
    ) -> None:
        url = f"{upstream}/w"
        await gateway.add_endpoint("w", url)
        auth = await gateway.new_key()
        r = await gateway.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
        assert r.status_code == 503, r.text  # the session's Redis has no replica
        err = r.json()["error"]
        assert err["code"] == "redis_unavailable" and "0 of 1" in err["message"]
        # Queued all the same (on the master only): its id lets the client follow it.
        assert (await gateway.status(auth, err["task_id"]))["task_status"] == "pending"


@pytest.mark.parametrize(("wait_replicas", "lag_s"), [(0, 0.0), (1, 1.0)])
def test_failover_under_load(tmp_path: Path, wait_replicas: int, lag_s: float) -> None:
    """kill -9 of the master while submits and calls run: the replica is promoted and the same
    gateway process carries on; every acknowledged task completes. With WAIT, none is lost even
    when the replica lagged a second behind (without, bench/failover.py counts the losses)."""
    fig = run_failover(tmp_path, wait_replicas, lag_s=lag_s)
    print(fig.line())
    assert not fig.gateway_restarted
    assert fig.acknowledged > 100 and fig.unfinished == 0
    assert fig.completed + fig.lost == fig.acknowledged, fig.line()
    assert fig.promoted_s < 10 and fig.recover_s < 10, fig.line()
    if wait_replicas:
        assert fig.lost == 0, fig.line()
