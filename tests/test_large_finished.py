"""A large inline result of a task Redis has let go (its row in SQL) is a large read like any
other: a read first takes the row without its result (its size from the result's meta), then
the key's read slot, and only then the megabytes; a read refused for want of a slot never
pulled them out of the database. Against the real SQLite database, whose statements are
watched (an event listener on the engine, nothing replaced)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event

from app.routes.large import LARGE
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import ADMIN, Gateway

SIZE = 2 << 20
#: A statement that reads the result column (not result_meta, result_status_code).
READS_RESULT = re.compile(r"task_results\.result(?!\w)|\bresult\b\s*(,|FROM)", re.IGNORECASE)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.result_inline_bytes = 4 << 20
    settings.done_ttl_s = 1  # written to SQL, gone from Redis a second later
    settings.read_ttl_s = 300
    settings.max_large_reads_per_key = 1
    return settings


def _statements(rt: Runtime) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(rt.engine.sync_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(rt.engine.sync_engine, "before_cursor_execute", record)


async def test_a_large_result_in_sql_leaves_the_database_only_within_a_slot(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    await gateway.add_endpoint("big", f"{upstream}/big")
    r = await gateway.http.post("/admin/v1/api-keys", headers={"Authorization": f"Bearer {ADMIN}"},
                                json={"user_id": 1})
    assert r.status_code == 201, r.text
    auth, key_id = {"Authorization": f"Bearer {r.json()['key']}"}, r.json()["id"]
    dispatcher = await start_dispatcher()
    tid = (await gateway.submit(auth, f"{upstream}/big",
                                headers={"X-Mock-Body-Bytes": [str(SIZE)]}))["task_id"]
    rt = gateway.rt
    for _ in range(600):  # read without delivering it: delivered, it would skip SQL
        view = await rt.queue.status(1, tid, None, deliver=False, result_limit=LARGE)
        if view.task_status.finished and not await rt.redis.exists(rt.keys.task(tid)):
            break
        await asyncio.sleep(0.1)
    assert view.task_status == "completed" and view.result_bytes == SIZE, view
    await dispatcher.stop(grace_s=1)
    url = f"/api/v1/tasks/{tid}"
    # The key's one slot taken: both reads are refused, and the result stayed in SQL.
    await rt.read_slots.take(key_id)
    watch = _statements(rt)
    seen = next(watch)
    for path in (url, f"{url}/result"):
        refused = await gateway.http.get(path, headers=auth)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_reads"
    assert seen and any("task_results" in s for s in seen), seen
    assert not [s for s in seen if READS_RESULT.search(s)], seen
    rt.read_slots.give(key_id)
    # Within a slot, the megabytes come whole, and a range of them.
    raw = json.dumps("x" * (SIZE - 2)).encode()
    whole = await gateway.http.get(f"{url}/result", headers=auth)
    assert whole.status_code == 200 and whole.content == raw
    assert [s for s in seen if READS_RESULT.search(s)], seen  # read now, within the slot
    part = await gateway.http.get(f"{url}/result", headers={**auth, "Range": "bytes=5-9"})
    assert part.status_code == 206 and part.content == raw[5:10]
    status = await gateway.http.get(url, headers=auth)
    assert status.status_code == 200 and status.json()["task_result"] == raw.decode()
    next(watch, None)
