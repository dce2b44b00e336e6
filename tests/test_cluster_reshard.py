"""A reshard under load: the slot of an endpoint's group moves to another master, keys and
all, while tasks are submitted and run; the gateway follows it without a restart and every
acknowledged task completes, served from the new master."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.crc import key_slot

from app.core.keys import Keys
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.topologies import ClusterSetup


@pytest.fixture
def settings(own_cluster: ClusterSetup, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=own_cluster.url, database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db",
        data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
        permit_secret="test-permit-secret", lease_ms=3000, reap_interval_ms=200)


async def test_an_endpoints_slot_moves_to_another_master_under_load(
    gateway: Gateway, upstream: str, own_cluster: ClusterSetup,
    start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{upstream}/moving"
    await gateway.add_endpoint("moving", url, max_concurrency=4)
    await start_dispatcher()
    auth = await gateway.new_key()
    keys: Keys = gateway.rt.keys
    slot = key_slot(keys.queue("moving").encode())
    before = own_cluster.master_for_slot(slot)
    to = next(f"node{i}" for i in range(3) if f"node{i}" != before)
    slow = {"X-Mock-Latency-Ms": ["50"]}
    acked = [(await gateway.submit(auth, url, headers=slow))["task_id"] for _ in range(30)]
    mover = asyncio.create_task(asyncio.to_thread(own_cluster.move_slot, slot, to))
    while not mover.done():  # submits keep coming while the keys move
        r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                    json={"target_url": url, "headers": slow})
        if r.status_code == 202:
            acked.append(r.json()["task_id"])
        else:  # the slot in between masters: a clear 503, never a 500
            assert r.status_code == 503, r.text
        await asyncio.sleep(0.01)
    await mover
    assert own_cluster.master_for_slot(slot) == to
    acked += [(await gateway.submit(auth, url))["task_id"] for _ in range(10)]
    done = await gateway.wait_finished(auth, acked, timeout=40)
    assert [d["task_status"] for d in done] == ["completed"] * len(acked)
