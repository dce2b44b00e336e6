"""QGW_REDIS_WAIT_REPLICAS when the node a submit ran on cannot count its replicas: one made a
replica between the script and its WAIT (a Cluster failover under load did it) answers the WAIT
with an error. The submit ran there, unconfirmed: a 503 to retry with the same Idempotency-Key,
as when the WAIT times out, never a 500."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from app.core.scripts import Lua
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import RedisServer
from tests.test_storage import open_gateway


@pytest.fixture
async def demoted(tmp_path: Path) -> AsyncIterator[Redis]:
    """A Redis made a replica of another, writable (`replica-read-only no`): a script still
    runs on it, as on the master it was a moment before, and its WAIT is refused."""
    master, node = RedisServer(tmp_path / "master"), RedisServer(tmp_path / "node")
    master.start()
    node.start()
    r = Redis.from_url(node.url, decode_responses=True)
    m = Redis.from_url(master.url)
    try:
        await m.config_set("repl-diskless-sync-delay", 0)  # not 5 s before the first sync
        await r.replicaof("127.0.0.1", master.port)
        await r.config_set("replica-read-only", "no")
        for _ in range(300):  # its first sync would wipe what is written before it
            if (await r.info("replication")).get("master_link_status") == "up":
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the replica never synced")
        yield r
    finally:
        await r.aclose()
        await m.aclose()
        node.stop()
        master.stop()


async def test_a_wait_the_node_refuses_is_an_unconfirmed_write(demoted: Redis) -> None:
    lua = Lua(demoted, "redis.call('SET', KEYS[1], ARGV[1]) return 'ran'")
    res, acked = await lua.call_and_wait(["k"], ["v"], 1, 500)
    assert (res, acked) == ("ran", 0)
    assert await demoted.get("k") == "v"


async def test_a_submit_whose_wait_is_refused_is_a_503_to_retry(
    demoted: Redis, tmp_path: Path, upstream: str
) -> None:
    url = demoted.connection_pool.connection_kwargs
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{url['port']}/0",
        database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db", data_dir=tmp_path,
        key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
        permit_secret="test-permit-secret", redis_wait_replicas=1,
    )
    async with open_gateway(settings) as gw:
        await _submitted_twice(gw, f"{upstream}/wait")


async def _submitted_twice(gw: Gateway, url: str) -> None:
    await gw.add_endpoint("wait", url)
    auth = await gw.new_key()
    once = {"Idempotency-Key": "order-1"}
    r = await gw.http.post("/api/v1/tasks", headers={**auth, **once}, json={"target_url": url})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "redis_unavailable" and r.headers["retry-after"]
    # It was queued (on this node only): the retry the answer asks for names that task.
    again = await gw.http.post("/api/v1/tasks", headers={**auth, **once},
                               json={"target_url": url})
    assert again.json().get("task_id") == error["task_id"], again.text
