"""A result object goes when its task goes, on every path that deletes a task, not later by
the sweep (app/lifecycle/orphans.py): read then let go (its row written or not), the janitor's
retention, an endpoint deleted, a purge while the answer uploads, an answer whose ack is
refused. The dispatchers here sweep with the default grace (an hour): nothing these tests
make is old enough for it, so what goes went with its task; and no test calls the sweep."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from app.lifecycle.results import OutboxWriter, ResultStore
from app.queue import operator
from app.queue.answers import ResultMeta
from app.queue.uploads import list_uploads
from app.settings import Settings
from tests.conftest import Gateway
from tests.servers import SeaweedFS
from tests.test_result_store import _objects

pytestmark = pytest.mark.backends("single", "cluster")
MB = 1_000_000
NO_SWEEP = {"QGW_RESULT_SWEEP_GRACE_S": "3600"}
#: The dispatcher's outbox writer runs once at its start and not again during the test: a
#: task read before its row is written (the writer's interval is 500 ms) is so for sure.
NO_WRITER = {**NO_SWEEP, "QGW_OUTBOX_INTERVAL_MS": "600000"}


@pytest.fixture
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """Room for a 400 MB answer; a store in SeaweedFS for a test's S3 run (`store_kind`)."""
    update: dict[str, Any] = {"max_result_bytes": 1 << 30}
    if "store_kind" in request.fixturenames and request.getfixturevalue("store_kind") == "s3":
        update["result_store"] = f"s3://{SeaweedFS.BUCKET}/{uuid.uuid4().hex[:12]}"
    return settings.model_copy(update=update)


async def _finished(gateway: Gateway, upstream: str, name: str, dispatcher_process: Any,
                    **env: str) -> tuple[dict[str, str], str, str]:
    """A task whose 2 MB answer is in the store, finished: its owner's auth, its id, and
    its object's key (read from its hash, which does not deliver it)."""
    url = f"{upstream}/{name}"
    await gateway.add_endpoint(name, url, timeout_ms=120_000, max_retries=0)
    auth = await gateway.new_key()
    dispatcher_process(**env)
    tid = (await gateway.submit(auth, url,
                                headers={"X-Mock-Binary": [f"{2 * MB};seed=2"]}))["task_id"]
    task = gateway.rt.keys.task(tid)
    deadline = time.monotonic() + 60
    while await gateway.rt.redis.hget(task, "status") != "completed":
        assert time.monotonic() < deadline, "the task did not finish"
        await asyncio.sleep(0.05)
    raw = await gateway.rt.redis.hget(task, "result_meta")
    meta = ResultMeta.loads(str(raw) if raw else None)
    assert meta is not None and meta.ref and await _objects(gateway) == [meta.ref]
    return auth, tid, meta.ref


def _writer(gateway: Gateway) -> OutboxWriter:
    rt = gateway.rt
    return OutboxWriter(rt.redis, rt.keys, rt.registry, ResultStore(rt.engine),
                        objects=rt.objects)


async def _row(gateway: Gateway, tid: str) -> Any:
    return await ResultStore(gateway.rt.engine).get(tid, 1)


async def _due_now(gateway: Gateway, endpoint: str) -> list[str]:
    """Make the endpoint's delivered tasks due (the read TTL of a result in the store is
    minutes); the members, as the read scheduled them."""
    key = gateway.rt.keys.delivered(endpoint)
    members = [str(m) for m in await gateway.rt.redis.zrange(key, 0, -1)]
    if members:
        await gateway.rt.redis.zadd(key, dict.fromkeys(members, 0))
    return members


async def test_a_result_read_before_its_row_was_written_goes_with_its_task(
    gateway: Gateway, upstream: str, dispatcher_process: Any, store_kind: str,
) -> None:
    """Read from Redis before the writer came: no row ever refers to the object, and its hash
    goes when the read TTL ends. The writer's deletion of the delivered task deletes the
    object then, by the key the read scheduled (file:// and S3)."""
    assert gateway.rt.objects.s3 == (store_kind == "s3")
    auth, tid, ref = await _finished(gateway, upstream, "readfirst", dispatcher_process,
                                     **NO_WRITER)
    (done,) = await gateway.wait_finished(auth, [tid])
    assert done["result_encoding"] == "external"
    assert await _due_now(gateway, "readfirst") == [ref]
    assert await _row(gateway, tid) is None
    await gateway.rt.redis.delete(gateway.rt.keys.task(tid))  # its read TTL, sooner
    await _writer(gateway).flush()
    assert await _objects(gateway) == []
    assert await gateway.rt.redis.zcard(gateway.rt.keys.delivered("readfirst")) == 0


async def test_a_result_read_from_its_row_goes_with_the_row(
    gateway: Gateway, upstream: str, dispatcher_process: Any,
) -> None:
    """Not read while Redis held it: its row refers to the object, and a read from SQL
    delivers it; the row and the object go together when that is due."""
    auth, tid, _ = await _finished(gateway, upstream, "fromsql", dispatcher_process,
                                     **NO_SWEEP)
    deadline = time.monotonic() + 30
    while await _row(gateway, tid) is None:
        assert time.monotonic() < deadline, "no row written"
        await asyncio.sleep(0.1)
    await gateway.rt.redis.delete(gateway.rt.keys.task(tid))  # its done TTL, sooner
    (done,) = await gateway.wait_finished(auth, [tid])
    assert done["result_encoding"] == "external"
    assert await _due_now(gateway, "fromsql") == [tid]
    await _writer(gateway).flush()
    assert await _row(gateway, tid) is None and await _objects(gateway) == []


async def test_the_janitor_deletes_an_unread_result_with_its_row(
    gateway: Gateway, upstream: str, dispatcher_process: Any,
) -> None:
    """Never read: the dispatcher's own janitor deletes its row after QGW_DB_RETENTION_S
    (1 s here), and its object in the same step, once Redis let the task go (a done TTL of
    3 s here): not before, while its hash names them."""
    _, tid, _ = await _finished(gateway, upstream, "retained", dispatcher_process,
                                QGW_DB_RETENTION_S="1", QGW_JANITOR_INTERVAL_S="0.3",
                                QGW_DONE_TTL_S="3", **NO_SWEEP)
    outbox, task = gateway.rt.keys.outbox("retained"), gateway.rt.keys.task(tid)
    deadline = time.monotonic() + 30
    while (await gateway.rt.redis.zscore(outbox, tid) is not None
           or await _row(gateway, tid) is not None):  # written to SQL, then purged
        # Past its retention, kept while Redis holds the task: an object gone means a
        # hash gone before it (which never comes back), never one left naming it.
        if await _objects(gateway) == []:
            assert not await gateway.rt.redis.exists(task)
        assert time.monotonic() < deadline, "the row was not purged"
        await asyncio.sleep(0.05)
    assert await _objects(gateway) == [] and not await gateway.rt.redis.exists(task)


async def test_deleting_an_endpoint_deletes_the_results_already_read(
    gateway: Gateway, upstream: str, dispatcher_process: Any,
) -> None:
    """Its owner read it (due to go in minutes), then the endpoint is deleted: no writer
    serves a deleted endpoint, so its delivered tasks and their objects go with it."""
    auth, tid, _ = await _finished(gateway, upstream, "retired", dispatcher_process,
                                   **NO_SWEEP)
    await gateway.wait_finished(auth, [tid])
    r = await gateway.http.delete("/admin/v1/endpoints/retired", headers=gateway.admin)
    assert r.status_code == 204, r.text
    assert await _objects(gateway) == [] and await _row(gateway, tid) is None
    assert await gateway.rt.redis.exists(gateway.rt.keys.delivered("retired")) == 0


def _staging(settings: Settings) -> list[Path]:
    root = settings.data_dir / "results"
    return [p for p in root.rglob("*#*")] if root.exists() else []


def _size(path: Path) -> int:
    """A staging file's size; 0 once gone (the abort may delete it between list and stat)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def test_a_purge_while_the_answer_uploads_leaves_nothing(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Any, settings: Settings,
    store_kind: str,
) -> None:
    """A purge cancels the running task: its call is aborted in the middle of storing a
    400 MB answer, and what was written of it goes at once: the staging file of a
    `file://` store, the multipart upload of an S3 one."""
    url = f"{fresh_upstream}/purged"
    await gateway.add_endpoint("purged", url, timeout_ms=120_000, max_retries=0)
    auth = await gateway.new_key()
    dispatcher_process(**NO_SWEEP)
    await gateway.submit(auth, url, headers={"X-Mock-Binary": [f"{400 * MB};seed=3"]})
    prefix = settings.result_store_url.rpartition("/")[2] + "/"

    async def uploading() -> bool:
        if store_kind == "file":
            return any(_size(p) > 0 for p in _staging(settings))
        return bool(await asyncio.to_thread(list_uploads, SeaweedFS.BUCKET, prefix))

    deadline = time.monotonic() + 60
    while not await uploading():
        assert time.monotonic() < deadline, "no upload began"
        await asyncio.sleep(0.05)
    r = await gateway.http.post("/admin/v1/endpoints/purged/purge", headers=gateway.admin)
    assert r.status_code == 200 and r.json()["cancelled"] == 1, r.text
    deadline = time.monotonic() + 10  # the abort reaches the call within a second or so
    while await uploading() or await _objects(gateway):
        assert time.monotonic() < deadline, "the purged task's upload is still there"
        await asyncio.sleep(0.1)


async def test_an_answer_whose_ack_is_refused_is_deleted_at_once(
    gateway: Gateway, upstream: str, start_dispatcher: Any,
) -> None:
    """The answer is stored, and the task is cancelled just before its ack: the ack is
    refused (the cancel took the lease), so no task will ever refer to the object, which
    goes at once rather than at the sweep."""
    url = f"{upstream}/refused"
    await gateway.add_endpoint("refused", url, timeout_ms=120_000, max_retries=0)
    auth = await gateway.new_key()
    rt = await start_dispatcher()
    acks = rt.dispatcher.acks
    real_ack = acks.ack

    async def cancelled_first(claim: Any, outcome: Any, exec_ms: float) -> int:
        assert outcome.meta is not None and outcome.meta.ref  # stored
        await operator.cancel(gateway.rt.queue, claim.task_id)
        return int(await real_ack(claim, outcome, exec_ms))

    acks.ack = cancelled_first
    tid = (await gateway.submit(auth, url,
                                headers={"X-Mock-Binary": [f"{2 * MB};seed=4"]}))["task_id"]
    (done,) = await gateway.wait_finished(auth, [tid])
    assert done["task_status"] == "cancelled"
    deadline = time.monotonic() + 5
    while await _objects(gateway):
        assert time.monotonic() < deadline, "the refused answer's object is still there"
        await asyncio.sleep(0.05)
