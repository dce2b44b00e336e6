"""A status answer with megabytes inline (QGW_RESULT_INLINE_BYTES raised) is whole and the same
on every read, though it is sent from an encoding the API keeps (app/routes/large.py) and the
status script leaves the result in Redis (status-6.lua, ARGV[5]); so is its /events event."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest

from app.routes.large import LARGE
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.test_events import events

pytestmark = pytest.mark.backends("single", "cluster")
SIZE = 2 << 20


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.result_inline_bytes = 4 << 20
    return settings


async def test_a_large_inline_status_is_whole_from_its_kept_encoding(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    await gateway.add_endpoint("big", f"{upstream}/big")
    auth = await gateway.new_key()
    small = await gateway.submit(auth, f"{upstream}/big")
    large = await gateway.submit(auth, f"{upstream}/big",
                                 headers={"X-Mock-Body-Bytes": [str(SIZE)]})
    await start_dispatcher()
    done = await gateway.wait_finished(auth, [small["task_id"], large["task_id"]])
    assert done[1]["task_result"] == json.dumps("x" * (SIZE - 2)), done[1]["result_bytes"]
    assert done[1]["result_bytes"] == SIZE > LARGE and done[1]["result_encoding"] is None
    assert gateway.rt.answers.size > SIZE  # kept, encoded (small answers are not)
    url = f"/api/v1/tasks/{large['task_id']}"
    first = await gateway.http.get(url, headers=auth)
    again = await gateway.http.get(url, headers=auth)
    assert first.status_code == again.status_code == 200
    assert first.content == again.content and first.json() == done[1]
    assert first.headers["content-type"] == "application/json"
    assert int(first.headers["content-length"]) == len(first.content)
    # The status call itself leaves the result in Redis; a short one comes whole.
    queue = gateway.rt.queue
    view = await queue.status(1, large["task_id"], None, result_limit=LARGE)
    assert view.result_left_out and view.task_result is None and view.result_bytes == SIZE
    view = await queue.status(1, small["task_id"], None, result_limit=LARGE)
    assert not view.result_left_out and view.task_result == done[0]["task_result"]
    # Another user's key is refused as ever, kept encoding or not.
    other = await gateway.new_key(user_id=2)
    assert (await gateway.http.get(url, headers=other)).status_code == 404
    # /result serves the same bytes from the kept copy, whole or a range of them.
    raw = json.dumps("x" * (SIZE - 2)).encode()
    whole = await gateway.http.get(f"{url}/result", headers=auth)
    assert whole.status_code == 200 and whole.content == raw
    assert int(whole.headers["content-length"]) == SIZE
    part = await gateway.http.get(f"{url}/result", headers={**auth, "Range": "bytes=-5"})
    assert part.status_code == 206 and part.content == raw[-5:], part.headers
    assert part.headers["content-range"] == f"bytes {SIZE - 5}-{SIZE - 1}/{SIZE}"
    # The SSE stream sends the same answer as its one event.
    async with gateway.http.stream("GET", f"{url}/events", headers=auth) as stream:
        assert stream.status_code == 200
        got = [ev async for ev in events(stream)]
    assert got == [done[1]]


