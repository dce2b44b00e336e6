"""Streams opened before a task ends are bounded like every other large read (issue "Hardening
2", item 1): 32 `/events` streams of one key follow a pending task; when it ends with an 8 MB
inline result, each final event is a large read. With QGW_MAX_LARGE_READS_PER_KEY=2, two streams
send it and the others, no slot freeing within the second's wait, end with `event: error`
`too_many_reads`. The clients read nothing while the task ends (a 64 KiB receive window): the
two slots stay taken by answers stalled on their sockets, so a stream that sent its large event
without a slot cannot pass for one that got a freed slot. Against a `qgw api` process."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from app.routes.large import LARGE
from app.runtime import Runtime
from app.settings import MAX_INLINE_BYTES, Settings
from tests.conftest import Gateway

StartApi = Callable[[], Awaitable[str]]
SIZE = 8 << 20
STREAMS, SLOTS = 32, 2


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.max_result_bytes = 16 << 20
    settings.result_inline_bytes = MAX_INLINE_BYTES
    settings.read_ttl_s = 300
    return settings


@pytest.fixture
def env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "QGW_MAX_LARGE_READS_PER_KEY": str(SLOTS), "QGW_READ_TTL_S": "300",
            "QGW_SEND_TIMEOUT_S": "60"}  # the stalled holders keep their slots


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event, data) of an SSE stream's lines, as they arrive."""
    kind = ""
    async for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])


async def test_streams_following_a_task_take_a_slot_for_its_large_final_event(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    start_api: StartApi,
) -> None:
    await gateway.add_endpoint("big", f"{upstream}/big", timeout_ms=60_000)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}/big", headers={"X-Mock-Body-Bytes": [str(SIZE)]})
    tid = task["task_id"]
    base = await start_api()
    small_window = httpx.AsyncHTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)])
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(
            base_url=base, headers=auth, timeout=60, transport=small_window,
            limits=httpx.Limits(max_connections=STREAMS + 4)))
        streams = []
        for _ in range(STREAMS):
            r = await stack.enter_async_context(http.stream("GET", f"/api/v1/tasks/{tid}/events"))
            assert r.status_code == 200
            ev = _events(r.aiter_lines())
            kind, first = await anext(ev)
            assert kind == "status" and first["task_status"] == "pending", first
            streams.append(ev)
        # The task ends while no stream is read: every one wakes to a large final event.
        await start_dispatcher()
        for _ in range(600):
            view = await gateway.rt.queue.status(1, tid, None, deliver=False, result_limit=LARGE)
            if view.task_status.finished:
                break
            await asyncio.sleep(0.1)
        assert view.task_status == "completed" and view.result_bytes == SIZE
        await asyncio.sleep(2.5)  # past the second a stream waits for a slot
        ends = await asyncio.gather(*(_last(ev) for ev in streams))
    large = [d for k, d in ends if k == "status" and d.get("result_bytes") == SIZE]
    refused = [d for k, d in ends if k == "error"]
    print(f"{STREAMS} streams, {SLOTS} slots: {len(large)} sent the 8 MB event, "
          f"{len(refused)} ended with too_many_reads")
    assert all(len(d["task_result"]) == SIZE for d in large)
    assert 1 <= len(large) <= SLOTS, len(large)
    assert len(refused) == STREAMS - len(large), ends
    assert all(d["error"]["code"] == "too_many_reads" for d in refused), refused


async def _last(ev: AsyncIterator[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """A stream's last event, read to its end (skipping `processing`)."""
    last: tuple[str, dict[str, Any]] = ("", {})
    async for kind, data in ev:
        last = (kind, data)
    return last
