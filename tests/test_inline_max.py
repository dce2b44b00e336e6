"""QGW_RESULT_INLINE_BYTES at its maximum on MariaDB: a binary answer that large is kept in the
task, as base64, reaches its SQL row and reads back byte for byte once Redis let it go (at the
12 MiB the setting allowed before, MariaDB cut the outbox writer's connection on every try)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Awaitable, Callable

import pytest
from pydantic import ValidationError

from app.lifecycle.results import ResultStore
from app.mock_upstream import binary_digest
from app.runtime import Runtime
from app.settings import MAX_INLINE_BYTES, Settings
from tests.conftest import Gateway
from tests.servers import MariaDB


@pytest.fixture
def settings(settings: Settings, mariadb: MariaDB) -> Settings:
    return settings.model_copy(update={
        "database_url": mariadb.create_database(f"inl{uuid.uuid4().hex[:12]}"),
        "result_inline_bytes": MAX_INLINE_BYTES, "max_result_bytes": 16 << 20})


def test_the_setting_stops_where_a_row_still_fits() -> None:
    with pytest.raises(ValidationError):
        Settings(result_inline_bytes=MAX_INLINE_BYTES + 1)
    # Its base64, and a dead letter's kept body of 64 Ki characters each JSON-escaped to 12
    # (an astral character) and each escaped again by MySQL: within one default packet.
    assert 4 * -(-MAX_INLINE_BYTES // 3) + (64 << 10) * 12 * 2 < 16 << 20


async def test_an_answer_of_the_largest_inline_size_reaches_sql_whole(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{upstream}/raw"
    await gateway.add_endpoint("raw", url, timeout_ms=60_000, max_retries=0)
    auth = await gateway.new_key()
    await start_dispatcher()
    tid = (await gateway.submit(auth, url, headers={
        "X-Mock-Binary": [f"{MAX_INLINE_BYTES};seed=5"]}))["task_id"]
    rt, store = gateway.rt, ResultStore(gateway.rt.engine)
    row = None
    for _ in range(600):  # not read by its owner: the outbox writes its row
        if (row := await store.get(tid, 1)) is not None:
            break
        await asyncio.sleep(0.1)
    assert row is not None and row.status == "completed", "no row: the writer was refused"
    assert len(row.result) == 4 * -(-MAX_INLINE_BYTES // 3)
    await rt.redis.delete(rt.keys.task(tid))  # as its done TTL would: the row answers now
    r = await gateway.http.get(f"/api/v1/tasks/{tid}/result", headers=auth)
    assert r.status_code == 200 and len(r.content) == MAX_INLINE_BYTES
    assert hashlib.sha256(r.content).digest() == binary_digest(MAX_INLINE_BYTES, 5)
