"""Large answers in the result store, streamed in and out, never whole in memory: `file://` and
S3 (SeaweedFS, a real S3 server), with a `qgw dispatcher` process whose memory is watched."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from app.mock_upstream import binary_digest
from app.queue import objects
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import SeaweedFS

pytestmark = pytest.mark.backends("single", "cluster")
MB = 1_000_000
BIG = 200 * MB


@pytest.fixture(params=["file", "s3"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def s3_env(store_kind: str, request: pytest.FixtureRequest,
           monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The AWS_* variables of the session's SeaweedFS (set here too, for the in-process API)."""
    if store_kind != "s3":
        return {}
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server.env()


@pytest.fixture
def settings(settings: Settings, store_kind: str, s3_env: dict[str, str],
             request: pytest.FixtureRequest) -> Settings:
    update: dict[str, Any] = {"max_result_bytes": 300 << 20}
    if store_kind == "s3":
        update["result_store"] = f"s3://{SeaweedFS.BUCKET}/{uuid.uuid4().hex[:12]}"
    return settings.model_copy(update=update)


async def peak_rss(proc: psutil.Process, stop: asyncio.Event) -> int:
    peak = 0
    while not stop.is_set():
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            break
        await asyncio.sleep(0.02)
    return peak


async def _objects(gateway: Gateway) -> list[str]:
    out: list[str] = []
    async for obj in gateway.rt.objects.listing(older_than_s=-60):
        out.append(obj.key)
    return out


async def test_a_200_mb_answer_streams_through_the_store_byte_exact(
    gateway: Gateway, upstream: str, dispatcher_process: Any, s3_env: dict[str, str],
    store_kind: str,
) -> None:
    """The dispatcher's memory grows by less than 64 MB while a 200 MB answer passes through
    it into the store; /result gives back the same bytes (hash), and a range of them."""
    url = f"{upstream}/video"
    await gateway.add_endpoint("video", url, timeout_ms=300_000, max_retries=0)
    auth = await gateway.new_key()
    proc = dispatcher_process(**s3_env)
    # A first large answer warms the process up (the store client's runtime, its
    # connections): what follows measures what the answer itself costs.
    warm = await gateway.submit(auth, url, headers={"X-Mock-Binary": ["2000000;seed=1"]})
    await gateway.wait_finished(auth, [warm["task_id"]], timeout=60)
    await asyncio.sleep(0.5)
    watched = psutil.Process(proc.pid)
    base = watched.memory_info().rss
    stop = asyncio.Event()
    peak = asyncio.create_task(peak_rss(watched, stop))
    task = await gateway.submit(auth, url,
                                headers={"X-Mock-Binary": [f"{BIG};seed=9;type=video/mp4"]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=240)
    stop.set()
    growth = (await peak) - base
    assert done["task_status"] == "completed", done
    assert done["result_encoding"] == "external" and done["result_bytes"] == BIG
    assert done["result_content_type"] == "video/mp4" and done["task_result"] is None
    print(f"{store_kind}: the dispatcher grew by {growth / 2**20:.1f} MiB during a 200 MB answer")
    assert growth < 64 << 20, f"the dispatcher grew by {growth / 2**20:.1f} MiB"
    h = hashlib.sha256()
    async with gateway.http.stream("GET", f"/api/v1/tasks/{task['task_id']}/result",
                                   headers=auth) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        async for chunk in r.aiter_bytes():
            h.update(chunk)
    assert h.digest() == binary_digest(BIG, 9)
    r = await gateway.http.get(f"/api/v1/tasks/{task['task_id']}/result",
                               headers={**auth, "Range": f"bytes={BIG - 1000}-"})
    assert r.status_code == 206 and len(r.content) == 1000
    assert r.headers["content-range"] == f"bytes {BIG - 1000}-{BIG - 1}/{BIG}"
    if store_kind == "s3":
        r = await gateway.http.get(f"/api/v1/tasks/{task['task_id']}/result?redirect=1",
                                   headers=auth)
        assert r.status_code == 302 and s3_env["AWS_ENDPOINT_URL"] in r.headers["location"]


async def test_an_answer_over_the_limit_midway_fails_and_leaves_no_object(
    gateway: Gateway, upstream: str, dispatcher_process: Any, s3_env: dict[str, str],
) -> None:
    """An answer without a Content-Length (chunked) that outgrows QGW_MAX_RESULT_BYTES while
    it is stored: failed at once, not retried, what was written removed."""
    url = f"{upstream}/toolarge"
    await gateway.add_endpoint("toolarge", url, timeout_ms=120_000, max_retries=3)
    auth = await gateway.new_key()
    dispatcher_process(**s3_env, QGW_MAX_RESULT_BYTES=str(20 << 20))
    task = await gateway.submit(
        auth, url, headers={"X-Mock-Binary": [f"{40 * MB};seed=1;chunked=1"]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=120)
    assert done["task_status"] == "failed" and done["attempts"] == 1
    assert "QGW_MAX_RESULT_BYTES" in done["task_result"]
    assert await _objects(gateway) == []


async def test_an_error_of_the_body_is_the_upstreams_and_one_of_the_store_the_stores(
    tmp_path: Path,
) -> None:
    """Both raise OSError: the upstream's connection reset while the body streams in passes
    through as itself (a call failure, tried again as one), never `result_store_unavailable`;
    a store that cannot write is StoreUnavailable. Nothing is left either way."""
    from app.queue.objects import ObjectStore, StoreUnavailable

    async def reset() -> AsyncIterator[bytes]:
        yield b"x" * 1000
        raise ConnectionResetError("reset by the upstream")

    async def body() -> AsyncIterator[bytes]:
        yield b"x" * 1000

    store = ObjectStore(f"file://{tmp_path}/results")
    with pytest.raises(ConnectionResetError, match="by the upstream"):
        await store.put("t/1", reset(), None)
    assert [p for p in (tmp_path / "results").rglob("*") if p.is_file()] == []
    shutil.rmtree(tmp_path / "results")
    (tmp_path / "results").write_bytes(b"")  # the store's directory is no directory now
    with pytest.raises(StoreUnavailable):
        await store.put("t/2", body(), None)


def test_the_results_directory_is_the_gateways_alone(tmp_path: Path) -> None:
    from app.queue.objects import ObjectStore

    ObjectStore(f"file://{tmp_path}/data/results")
    assert (tmp_path / "data" / "results").stat().st_mode & 0o777 == 0o700


@pytest.mark.backends("single")  # no Redis in it
async def test_a_store_that_stops_answering_fails_each_request_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3 endpoint that takes connections and never answers (a store hung, a partition):
    a read, a delete and the readiness check fail as unavailable, a best-effort delete gives
    up, and a put cut by its call's timeout returns, each within its bound (STORE_OP_S, 0.5 s
    here); before, each waited for the client's own timeout, a day."""
    monkeypatch.setattr(objects, "STORE_OP_S", 0.5)
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"),
                        ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    store = objects.ObjectStore("s3://quiet/results")

    async def body() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"x" * (1 << 20)

    async def cut_put() -> None:
        async with asyncio.timeout(1):  # the call's own bound (upstream.call)
            await store.put("t.e/1", body(), "image/png")

    loop = asyncio.get_running_loop()
    try:
        for name, op, fails in (("read", store.read("t.e/1"), objects.StoreUnavailable),
                                ("delete", store.delete(["t.e/1"]), objects.StoreUnavailable),
                                ("check", store.check(), objects.StoreUnavailable),
                                ("put", cut_put(), TimeoutError),
                                ("drop", store.drop(["t.e/1"]), None),
                                ("discard", store.discard("t.e/1"), None)):
            started = loop.time()
            async with asyncio.timeout(5):  # the test's own bound: a hang fails here
                if fails is None:
                    await op
                else:
                    with pytest.raises(fails):
                        await op
            assert loop.time() - started < 3, name
    finally:
        server.close()
        for writer in held:
            writer.close()


@pytest.mark.parametrize("store_kind", ["s3"])  # presigned URLs are S3's
async def test_a_presigned_url_never_outlives_its_object(
    gateway: Gateway, upstream: str, start_dispatcher: Any, store_kind: str,
) -> None:
    """The object of a read result goes at a time set by its first read, never put off: a
    redirect signs its URL for what is left of that (less a minute for a download begun at
    its end), and serves the bytes itself when under half a minute would be left (a link
    valid for five minutes outlived its object)."""
    url = f"{upstream}/signed"
    await gateway.add_endpoint("signed", url, max_retries=0)
    auth = await gateway.new_key()
    await start_dispatcher()
    task = await gateway.submit(auth, url, headers={"X-Mock-Binary": [f"{MB};seed=4"]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=60)  # read: due
    assert done["result_encoding"] == "external"
    rt, tid = gateway.rt, task["task_id"]
    ref = json.loads(str(await rt.redis.hget(rt.keys.task(tid), "result_meta")))["ref"]
    delivered = rt.keys.delivered("signed")
    path = f"/api/v1/tasks/{tid}/result?redirect=1"

    async def due_in(seconds: int) -> None:
        now_s, now_us = await rt.redis.time()
        await rt.redis.zadd(delivered, {ref: now_s * 1000 + now_us // 1000 + seconds * 1000},
                            xx=True)

    r = await gateway.http.get(path, headers=auth)
    assert r.status_code == 302 and 290 <= _expires(r.headers["location"]) <= 300
    await due_in(100)
    r = await gateway.http.get(path, headers=auth)
    assert r.status_code == 302 and 35 <= _expires(r.headers["location"]) <= 40
    await due_in(80)
    r = await gateway.http.get(path, headers=auth)
    assert r.status_code == 200 and hashlib.sha256(r.content).digest() == binary_digest(MB, 4)
    # Read from its SQL row, a task's deletion is scheduled by its id: that counts too.
    await rt.redis.zrem(delivered, ref)
    now_s, now_us = await rt.redis.time()
    await rt.redis.zadd(delivered, {tid: now_s * 1000 + now_us // 1000 + 100_000})
    r = await gateway.http.get(path, headers=auth)
    assert r.status_code == 302 and 35 <= _expires(r.headers["location"]) <= 40


def _expires(url: str) -> int:
    return int(url.split("X-Amz-Expires=")[1].split("&")[0])
