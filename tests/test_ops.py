"""GET /readyz: ready while Redis takes writes; the database's state is reported, and an
outage that submit survives keeps the API process in rotation (docs/api.md, Operations)."""

from __future__ import annotations

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from app.main import create_app
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway, _migrated
from tests.servers import RedisServer, free_port
from tests.test_storage import Outage, SqliteOutageCase


class TestRedisReadOnly:
    @pytest.fixture
    def settings(self, settings: Settings, own_redis: RedisServer) -> Settings:
        """Overrides conftest's: this test demotes its Redis to a replica."""
        return settings.model_copy(update={"redis_url": own_redis.url})

    async def test_a_redis_that_refuses_writes_makes_the_process_unready(
        self, gateway: Gateway
    ) -> None:
        r = await gateway.http.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "checks": {"redis": "ok", "database": "ok",
                                                    "result_store": "ok"}}
        # A replica (here of a master that is not there) answers PING but refuses submits.
        await gateway.rt.redis.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]  # untyped in redis-py
        try:
            assert await gateway.rt.redis.ping()
            r = await gateway.http.get("/readyz")
            assert r.status_code == 503, r.text
            assert r.json()["checks"]["redis"] == "error: ReadOnlyError"
        finally:
            await gateway.rt.redis.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]  # untyped in redis-py
        assert (await gateway.http.get("/readyz")).status_code == 200


class TestDatabaseOutage(SqliteOutageCase):

    async def test_a_database_outage_is_reported_and_the_process_stays_ready(
        self, gateway: Gateway, outage: Outage, upstream: str
    ) -> None:
        url = f"{upstream}/readyz-db"
        await gateway.add_endpoint("readyz-db", url)
        auth = await gateway.new_key()
        outage.engines.append(gateway.rt.engine)
        await outage.down()
        try:
            r = await gateway.http.get("/readyz")
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "degraded"
            assert r.json()["checks"]["redis"] == "ok"
            assert r.json()["checks"]["database"].startswith("error: ")
            await gateway.submit(auth, url)  # what readiness promises: submit still works
        finally:
            await outage.up()
        assert (await gateway.http.get("/readyz")).json()["status"] == "ok"


@pytest.mark.backends("single", "cluster")
async def test_on_a_cluster_each_process_probes_readiness_in_a_slot_its_id_picks(
    settings: Settings, backend: str
) -> None:
    """/readyz writes a key: on a Cluster, processes of different ids write theirs on
    different masters (here one in the first group of slots, one in the last), so a master's
    failover takes out of rotation only the processes probing it. One Redis: one key, as ever."""
    await _migrated(settings)
    for ident in ("api-8", "api-5"):  # groups 2 and 15 (app/core/keys.py group_of)
        rt = Runtime(settings, ident=ident)
        await rt.start()
        try:
            app = create_app(rt, manage=False)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://gateway") as http:
                assert (await http.get("/readyz")).status_code == 200
            if isinstance(rt.redis, RedisCluster):
                probes = await rt.redis.keys(f"{settings.key_prefix}*readyz*",
                                             target_nodes=RedisCluster.PRIMARIES)
                nodes: set[str] = {rt.redis.get_node_from_key(k).name for k in probes}
                slots: set[int] = {key_slot(k.encode()) for k in probes}
            else:
                probes = await rt.redis.keys(f"{settings.key_prefix}*readyz*")
        finally:
            await rt.stop()
    if backend == "cluster":
        assert len(probes) == len(slots) == len(nodes) == 2, probes
    else:
        assert probes == [f"{settings.key_prefix}:readyz"]
