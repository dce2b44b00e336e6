"""Result objects follow their tasks (app/lifecycle/orphans.py): deleted with the row, swept
once their task has gone, nothing left by a dispatcher killed mid-upload, and a store that
goes down fails the call's task clearly instead of losing its answer."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from app.db import utcnow
from app.lifecycle.janitor import Janitor
from app.lifecycle.orphans import OrphanSweep
from app.queue.uploads import list_uploads
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import SeaweedFS
from tests.test_result_store import _objects

pytestmark = pytest.mark.backends("single", "cluster")
MB = 1_000_000


def _sweep(gateway: Gateway) -> OrphanSweep:
    rt = gateway.rt
    return OrphanSweep(rt.objects, rt.redis, rt.keys, rt.engine, 3600)


def _staging(settings: Settings) -> list[Path]:
    root = settings.data_dir / "results"
    return [p for p in root.rglob("*#*")] if root.exists() else []


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_result_bytes": 1 << 30, "read_ttl_s": 1})


async def _finished(gateway: Gateway, upstream: str, name: str, size: int,
                    dispatcher_process: Any, **env: str) -> tuple[dict[str, str], str]:
    url = f"{upstream}/{name}"
    await gateway.add_endpoint(name, url, timeout_ms=120_000, max_retries=0)
    auth = await gateway.new_key()
    dispatcher_process(**env)
    task = await gateway.submit(auth, url, headers={"X-Mock-Binary": [f"{size};seed=2"]})
    return auth, task["task_id"]


async def test_a_read_result_goes_with_its_task_and_a_kept_one_with_its_row(
    gateway: Gateway, upstream: str, dispatcher_process: Any
) -> None:
    """Read: the task is delivered, Redis lets it go after the read TTL, and the sweep finds
    its object unreferenced. Unread: its row reaches SQL; the janitor's purge deletes the row
    and the object together. The sweep never takes an object a task still refers to."""
    auth, read = await _finished(gateway, upstream, "life", 2 * MB, dispatcher_process)
    (done,) = await gateway.wait_finished(auth, [read], timeout=60)
    assert done["result_encoding"] == "external" and len(await _objects(gateway)) == 1
    assert await _sweep(gateway).sweep(grace_s=0) == 0  # still its task's
    unread = (await gateway.submit(auth, f"{upstream}/life",
                                   headers={"X-Mock-Binary": [f"{2 * MB};seed=3"]}))["task_id"]
    for _ in range(300):  # finished and moved to SQL, never read by its owner
        row = await gateway.rt.queue.results.get(unread, 1)  # type: ignore[union-attr]
        if row is not None:
            break
        await asyncio.sleep(0.1)
    assert row is not None and len(await _objects(gateway)) == 2
    # An external result is kept past the read for minutes (Ttls.read_external_ms): make its
    # row due now, and let its hash go as its TTL would, sooner.
    await gateway.rt.redis.zadd(gateway.rt.keys.delivered("life"), {read: 0})
    await gateway.rt.redis.delete(gateway.rt.keys.task(read))
    for _ in range(100):
        if await gateway.rt.queue.results.get(read, 1) is None:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.1)
    assert await _sweep(gateway).sweep(grace_s=0) in (0, 1)  # the writer may have done it
    assert len(await _objects(gateway)) == 1
    (left,) = await _objects(gateway)
    assert left.startswith(unread)
    janitor = Janitor(gateway.rt.engine, 1, objects=gateway.rt.objects)
    stats = await janitor.purge(cutoff=utcnow().replace(year=2100))
    assert stats.rows >= 1 and await _objects(gateway) == []


async def test_an_external_result_outlives_the_read_ttl_for_a_resumed_download(
    gateway: Gateway, upstream: str, dispatcher_process: Any
) -> None:
    """A result in the store is fetched in pieces after the status read that delivers it (a
    resumed Range download, a presigned URL): it stays well past QGW_READ_TTL_S (1 s here),
    where an inline one read alike is gone."""
    auth, big = await _finished(gateway, upstream, "keep", 2 * MB, dispatcher_process)
    small = (await gateway.submit(auth, f"{upstream}/keep", headers={
        "X-Mock-Binary": ["1000;seed=2"]}))["task_id"]
    done = await gateway.wait_finished(auth, [big, small], timeout=60)  # read: delivered
    assert [d["result_encoding"] for d in done] == ["external", "base64"]
    url = f"/api/v1/tasks/{big}/result"
    r = await gateway.http.get(url, headers={**auth, "Range": "bytes=0-999"})
    assert r.status_code == 206
    await asyncio.sleep(4)  # the read TTL and the writer's deletion of delivered rows
    assert (await gateway.http.get(f"/api/v1/tasks/{small}", headers=auth)).status_code == 404
    r = await gateway.http.get(url, headers={**auth, "Range": f"bytes=1000-{2 * MB - 1}"})
    assert r.status_code == 206 and len(r.content) == 2 * MB - 1000
    assert 300_000 < await gateway.rt.redis.pttl(gateway.rt.keys.task(big)) <= 360_000


@pytest.mark.parametrize("store_kind", ["file", "s3"])
async def test_a_dispatcher_killed_mid_upload_leaves_nothing_after_the_sweep(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Any, store_kind: str,
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, settings: Settings,
) -> None:
    """A dispatcher killed with -9 while it stores a 400 MB answer; the dispatcher running
    next cleans up by itself, with its periodic sweep (every second here, objects older
    than 2 s): no object, no staging file or empty task folder of a `file://` store, no
    unfinished S3 multipart upload. No sweep is called here. (The killed one keeps the
    default grace, an hour: its own sweep must not take the upload it is making.)"""
    env: dict[str, str] = {"QGW_RESULT_SWEEP_INTERVAL_S": "1"}
    if store_kind == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        env.update(server.env())
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        prefix = uuid.uuid4().hex[:12]
        env["QGW_RESULT_STORE"] = f"s3://{SeaweedFS.BUCKET}/{prefix}"
        from app.queue.objects import ObjectStore

        gateway.rt.objects = ObjectStore(env["QGW_RESULT_STORE"])

    async def uploads() -> list[Any]:
        if store_kind == "file":
            return []
        return await asyncio.to_thread(list_uploads, SeaweedFS.BUCKET,
                                       env["QGW_RESULT_STORE"].split("/")[-1] + "/")

    started: list[subprocess.Popen[bytes]] = []

    def dispatcher(**extra: str) -> subprocess.Popen[bytes]:
        started.append(dispatcher_process(**extra))
        return started[-1]

    # An upstream of its own: it goes on sending to the dead connection a while.
    await _finished(gateway, fresh_upstream, "killed", 400 * MB, dispatcher, **env)
    deadline = time.monotonic() + 120
    while True:  # the upload is under way: a staging file, or an S3 multipart upload
        if store_kind == "file" and any(p.stat().st_size > 0 for p in _staging(settings)):
            break
        if store_kind == "s3" and await uploads():
            break
        assert time.monotonic() < deadline, "no upload began"
        await asyncio.sleep(0.05)
    for proc in started:  # kill -9
        proc.kill()
        proc.wait(10)
    assert _staging(settings) or await uploads()  # left behind, for now
    dispatcher_process(**env, QGW_RESULT_SWEEP_GRACE_S="2")
    root = settings.data_dir / "results"
    deadline = time.monotonic() + 60
    while (await _objects(gateway) or await uploads()
           or (root.exists() and any(root.iterdir()))):
        assert time.monotonic() < deadline, "the running dispatcher's sweep left something"
        await asyncio.sleep(0.2)


async def test_the_store_stopped_mid_run_fails_the_task_clearly(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3 server of its own, stopped while a large answer is being stored: the call is
    tried again (its answer was not kept), and once out of attempts the task fails with
    `result_store_unavailable`; /readyz reports the store meanwhile, and stays ready."""
    server = SeaweedFS(tmp_path / "s3")
    server.start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        store = f"s3://{SeaweedFS.BUCKET}/down"
        from app.queue.objects import ObjectStore

        gateway.rt.objects = ObjectStore(store)
        url = f"{fresh_upstream}/down"
        await gateway.add_endpoint("down", url, timeout_ms=120_000, max_retries=1,
                                   retry_backoff_ms=100)
        auth = await gateway.new_key()
        dispatcher_process(**server.env(), QGW_RESULT_STORE=store)
        task = await gateway.submit(auth, url, headers={"X-Mock-Binary": [f"{400 * MB};seed=1"]})
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(list_uploads, SeaweedFS.BUCKET, "down/"):
            assert time.monotonic() < deadline, "no upload began"
            await asyncio.sleep(0.05)
        server.stop()
        (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=180)
        assert done["task_status"] == "failed" and done["attempts"] == 2, done
        assert done["task_result"].startswith("result_store_unavailable"), done["task_result"]
        r = await gateway.http.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"]["result_store"].startswith("error")
    finally:
        server.stop()
