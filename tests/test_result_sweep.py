"""The result store's sweep (app/lifecycle/orphans.py): one dispatcher of all sweeps in an
interval, under a Redis lock, and it walks the listing a batch at a time to the end."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from app.db import utcnow
from app.lifecycle.orphans import SWEEP_LOCK, OrphanSweep
from app.lifecycle.results import ResultStore
from app.queue import uploads
from app.queue.answers import external
from app.queue.objects import ObjectStore
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import SeaweedFS
from tests.test_result_store import _objects

pytestmark = pytest.mark.backends("single", "cluster")


async def _put(objects: ObjectStore, key: str) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"x" * 100

    await objects.put(key, body(), "application/octet-stream")


def _sweeper(gateway: Gateway, interval_s: float = 300, list_batch: int = 1000) -> OrphanSweep:
    rt = gateway.rt
    return OrphanSweep(rt.objects, rt.redis, rt.keys, rt.engine, 0, interval_s, list_batch)


async def test_two_dispatchers_at_once_one_sweeps_and_none_again_that_interval(
    gateway: Gateway,
) -> None:
    """Two dispatchers' sweeps due at the same moment: one takes the lock and sweeps, the
    other skips (None); the lock outlives the sweep for the interval (counted by Redis), so
    neither sweeps again before it has passed, and after it one does."""
    for i in range(20):
        await _put(gateway.rt.objects, f"{uuid.uuid4().hex}.gone/{i}")
    first, second = _sweeper(gateway, interval_s=2), _sweeper(gateway, interval_s=2)
    got = await asyncio.gather(first.run_once(), second.run_once())
    assert sorted(got, key=str) == [20, None], got
    assert await _objects(gateway) == []
    left = await gateway.rt.redis.pttl(gateway.rt.keys.lock(SWEEP_LOCK))
    assert 0 < left <= 2000
    await _put(gateway.rt.objects, f"{uuid.uuid4().hex}.gone/late")
    assert await first.run_once() is None and await second.run_once() is None
    assert len(await _objects(gateway)) == 1
    await asyncio.sleep(left / 1000 + 0.1)
    assert await second.run_once() == 1 and await _objects(gateway) == []


@pytest.fixture
def settings(settings: Settings, store_kind: str) -> Settings:
    if store_kind == "file":
        return settings
    store = f"s3://{SeaweedFS.BUCKET}/{uuid.uuid4().hex[:12]}"
    return settings.model_copy(update={"result_store": store})


async def test_a_store_of_many_listing_batches_is_swept_to_the_end(
    gateway: Gateway, store_kind: str,
) -> None:
    """35 orphans among objects a task still refers to (in its Redis hash, in its SQL row),
    listed 10 at a time: every orphan goes, every referenced object stays."""
    rt, objects = gateway.rt, gateway.rt.objects
    orphans = [f"{uuid.uuid4().hex}.gone/{i}" for i in range(35)]
    in_redis, in_sql = f"{uuid.uuid4().hex}.kept", f"{uuid.uuid4().hex}.kept"
    kept = [ObjectStore.new_key(in_redis), ObjectStore.new_key(in_sql)]
    for key in [*orphans, *kept]:
        await _put(objects, key)
    meta = [external(key, 100, {"content-type": "image/png"}).dumps() for key in kept]
    await rt.redis.hset(rt.keys.task(in_redis), mapping={"status": "completed",
                                                         "result_meta": meta[0]})
    await ResultStore(rt.engine).upsert([{
        "task_id": in_sql, "user_id": 1, "endpoint": "kept", "type": "offline",
        "status": "completed", "result": None, "result_status_code": 200, "attempts": 1,
        "created_at": utcnow(), "started_at": None, "ended_at": None, "priority": 0,
        "request": None, "result_meta": meta[1]}])
    sizes = [len(batch) async for batch in objects.batches(0, 10)]
    assert max(sizes) <= 10 and sum(sizes) == 37  # a page at a time, never the whole store
    sweep = _sweeper(gateway, list_batch=10)
    assert await sweep.run_once() == 35
    assert sorted(await _objects(gateway)) == sorted(kept)



async def test_unfinished_s3_uploads_are_aborted_page_after_page(
    seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five uploads a killed process left, listed two at a time: all five aborted."""
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    prefix = uuid.uuid4().hex[:12]
    objects = ObjectStore(f"s3://{SeaweedFS.BUCKET}/{prefix}")
    for i in range(5):  # CreateMultipartUpload, never completed
        await asyncio.to_thread(uploads._request, "POST", SeaweedFS.BUCKET,
                                f"{prefix}/{uuid.uuid4().hex}.gone/{i}", {"uploads": ""})
    assert len(await asyncio.to_thread(uploads.list_uploads, SeaweedFS.BUCKET, prefix)) == 5
    assert await uploads.abort_stale_uploads(objects, -60, page=2) == 5
    assert await asyncio.to_thread(uploads.list_uploads, SeaweedFS.BUCKET, prefix) == []
