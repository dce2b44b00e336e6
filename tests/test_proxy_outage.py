"""The drop-in proxy against a Redis of its own, which the test stops and starts again: a call
that streams on while Redis is away is still recorded as it ended once Redis is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import RedisServer, mock_log
from tests.test_proxy import CHAT, StartApi, StartDispatcher, llm, openai_server, proxied

__all__ = ["llm", "openai_server"]


@pytest.fixture
def settings(own_redis: RedisServer, tmp_path: Path) -> Settings:
    """Overrides conftest's: the test's own Redis, and a lease (12 s) well past its outage and
    the ack's retries after it (back-off of up to 2 s, jittered)."""
    return Settings(
        redis_url=own_redis.url, database_url=f"sqlite+aiosqlite:///{tmp_path}/qgw.db",
        data_dir=tmp_path, key_prefix=f"t{uuid.uuid4().hex[:10]}", admin_token=ADMIN,
        permit_secret="test-permit-secret", lease_ms=12000, reap_interval_ms=200,
    )


async def test_an_ack_redis_missed_lands_once_it_is_back(
    gateway: Gateway, llm: str, own_redis: RedisServer, start_api: StartApi,
    start_dispatcher: StartDispatcher,
) -> None:
    """Redis stops while the answer streams and starts again 2.5 s later: the ack written at
    the answer's end fails, is sent again until Redis takes it, and the task ends `completed`
    (not `failed` "caller connection lost" by the reaper once its lease lapsed)."""
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()  # its reaper would end a task whose ack never landed
    httpx.post(f"{llm}/_mock/config", json={"chunks": 6, "chunk_ms": 250}).raise_for_status()
    events: list[str] = []
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        async with http.stream("POST", "/proxy/llm/chat/completions",
                               json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200
            task_id = r.headers["x-queue-task-id"]
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if not events:  # admitted and streaming: Redis goes away
                        await asyncio.to_thread(own_redis.stop)
                        stopped = time.monotonic()
                    events.append(line)
    assert events[-1] == "data: [DONE]" and len(events) == 9  # the whole answer
    await asyncio.sleep(max(0.0, stopped + 2.5 - time.monotonic()))  # past the stream's end
    await asyncio.to_thread(own_redis.start)  # same port, same append-only file
    deadline = time.monotonic() + 20
    while (status := await _status(gateway, auth, task_id)) in (None, "processing"):
        assert time.monotonic() < deadline, "the task never ended"
        await asyncio.sleep(0.1)
    assert status == "completed"
    assert [e["idempotency_key"] for e in mock_log(llm)] == [task_id]  # called once


async def _status(gateway: Gateway, auth: dict[str, str], task_id: str) -> str | None:
    """The task's status; None while Redis is still loading its data."""
    r = await gateway.http.get(f"/api/v1/tasks/{task_id}", headers=auth)
    if r.status_code == 503:
        return None
    assert r.status_code == 200, r.text
    return str(r.json()["task_status"])
