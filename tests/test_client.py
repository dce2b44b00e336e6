"""The Python client (clients/python, `queue_gateway_client`) against a real `qgw api` process,
a `qgw dispatcher` process and the mock upstream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import httpx
import pytest
from queue_gateway_client import (
    ApiError,
    AsyncClient,
    Client,
    QueueGatewayError,
    TaskFailed,
    WaitTimeout,
)

from tests.conftest import Gateway

StartApi = Callable[[], Awaitable[str]]
Spawn = Callable[..., subprocess.Popen[bytes]]
MAX_RETRY_AFTER_S = 60  # the clients' default max_retry_after: a longer Retry-After is raised


async def _setup(gateway: Gateway, upstream: str, endpoint: str, **fields: object
                 ) -> tuple[str, str]:
    """Register `endpoint`; returns its URL and a new API key."""
    url = f"{upstream}/{endpoint}"
    await gateway.add_endpoint(endpoint, url, **fields)
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 1, "max_priority": 5})
    return url, str(r.json()["key"])


async def test_sync_client_submits_and_returns_the_result(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn
) -> None:
    url, key = await _setup(gateway, upstream, "cl-sync")
    base = await start_api()
    dispatcher_process()
    sent: list[httpx.Request] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            sent.append(request)
            return super().handle_request(request)

    def run() -> tuple[str, str, str]:
        with Client(base, key, transport=Recording()) as qgw:
            task = qgw.submit(url, body='{"prompt": "cat"}', priority=2,
                              headers={"Content-Type": "application/json"})
            again = qgw.submit(url, body="x", idempotency_key="fixed")
            same = qgw.submit(url, body="x", idempotency_key="fixed")
            assert again.task_id == same.task_id != task.task_id
            return task.task_id, task.result(timeout=30), again.wait(30).task_status

    task_id, result, status = await asyncio.to_thread(run)
    assert json.loads(result)["ok"] is True and status == "completed"
    submits = [r for r in sent if r.method == "POST"]
    assert len(submits) == 3 and all(r.headers.get("idempotency-key") for r in submits)
    waits = [r for r in sent if r.method == "GET"]
    assert len(waits) <= 8  # a long poll per change, not a loop of polls
    assert (await gateway.status({"Authorization": f"Bearer {key}"}, task_id))[
        "task_status"] == "completed"


async def test_async_client_waits_on_the_event_stream(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn
) -> None:
    url, key = await _setup(gateway, upstream, "cl-async")
    base = await start_api()
    dispatcher_process()
    async with AsyncClient(base, key) as qgw:
        task = await qgw.submit(url, body="hi", headers={"X-Mock-Latency-Ms": ["700"]})
        assert task.submitted is not None and task.submitted.task_status == "pending"
        final = await task.wait(timeout=30)
        answered = time.time()
        assert final.task_status == "completed" and final.finished
        assert final.ended_at is not None
        assert answered - datetime.fromisoformat(final.ended_at).timestamp() < 1.0
        assert json.loads(await task.result(5))["ok"] is True
        assert (await qgw.task(task.task_id).status()).task_status == "completed"


async def test_result_raises_task_failed_and_wait_times_out(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn
) -> None:
    url, key = await _setup(gateway, upstream, "cl-fail", max_concurrency=1, max_retries=0)
    base = await start_api()
    dispatcher_process()
    async with AsyncClient(base, key) as qgw:
        failing = await qgw.submit(url, headers={"X-Mock-Status": "404"})
        with pytest.raises(TaskFailed) as failed:
            await failing.result(timeout=30)
        assert failed.value.status.task_status == "failed"
        assert failed.value.status.result_status_code == 404
        await qgw.submit(url, headers={"X-Mock-Latency-Ms": "3000"})  # holds the one slot
        queued = await qgw.submit(url)
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as late:
            await queued.wait(timeout=0.5)
        assert time.monotonic() - started < 1.5
        assert late.value.status is not None and late.value.status.task_status == "pending"
        assert await queued.cancel() == "cancelled"
        with pytest.raises(TaskFailed, match="cancelled"):
            await queued.result(timeout=10)
        with pytest.raises(ApiError) as gone:
            await qgw.task(f"{'0' * 32}.cl-fail").status()
        assert gone.value.status_code == 404 and gone.value.code == "task_not_found"

    def sync_side() -> None:
        with Client(base, key) as qgw:
            with pytest.raises(TaskFailed):
                qgw.task(queued.task_id).result(timeout=5)
            with pytest.raises(WaitTimeout):
                qgw.submit(url).wait(timeout=0.3)

    await asyncio.to_thread(sync_side)


async def test_503_is_retried_after_retry_after_and_a_long_one_is_not(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn
) -> None:
    # One admission an hour, already spent by the first task; a queue of one.
    url, key = await _setup(gateway, upstream, "cl-full", rate=1, interval_ms=3_600_000,
                            max_queue_len=1)
    await gateway.add_endpoint("cl-quota", f"{upstream}/cl-quota")
    base = await start_api()
    dispatcher_process()
    with Client(base, key) as qgw:
        await asyncio.to_thread(qgw.submit, url)
        await asyncio.sleep(1)  # the first one is admitted
        queued = await asyncio.to_thread(qgw.submit, url)
    with Client(base, key, retries=0) as impatient:
        with pytest.raises(ApiError) as full:
            await asyncio.to_thread(impatient.submit, url)
    assert full.value.status_code == 503 and full.value.code == "queue_full"

    # Room comes back a second later; the queue_full answer said "Retry-After: 5".
    def make_room() -> None:
        with Client(base, key) as other:
            other.task(queued.task_id).cancel()

    threading.Timer(1.0, make_room).start()
    started = time.monotonic()
    with Client(base, key) as qgw:
        task = await asyncio.to_thread(qgw.submit, url)
    assert task.task_id != queued.task_id and 4.5 < time.monotonic() - started < 15

    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 2, "daily_quota": 1})
    # A day's quota ends at midnight UTC (the Redis clock's): within a minute of it the
    # Retry-After is short enough for the client to hold on, and the next day lets it in.
    now_s, _ = await gateway.rt.redis.time()
    if (to_midnight := 86_400 - now_s % 86_400) < MAX_RETRY_AFTER_S + 30:
        await asyncio.sleep(to_midnight + 1)
    async with AsyncClient(base, str(r.json()["key"])) as limited:
        await limited.submit(f"{upstream}/cl-quota", idempotency_key="a")
        started = time.monotonic()
        with pytest.raises(ApiError) as quota:  # retry at midnight: not worth holding on
            await limited.submit(f"{upstream}/cl-quota", idempotency_key="b")
    assert quota.value.status_code == 429 and time.monotonic() - started < 2
    assert isinstance(quota.value, QueueGatewayError)


async def test_openapi_operation_ids_read_as_method_names(gateway: Gateway) -> None:
    doc = (await gateway.http.get("/openapi.json")).json()
    ops = {(path, method): op["operationId"] for path, methods in doc["paths"].items()
           for method, op in methods.items()}
    assert ops[("/api/v1/tasks", "post")] == "submit_task"
    assert ops[("/api/v1/tasks/{task_id}/events", "get")] == "follow_task"
    assert len(set(ops.values())) == len(ops)
