"""A result store that takes connections and never answers (hung, or cut off by a partition),
while a large answer streams into it: the call is the store's failure, not the upstream's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator

import pytest

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway


@pytest.fixture
def quiet_port() -> Iterator[int]:
    """A listening socket nobody accepts from: the kernel completes connections into its
    backlog, and requests sent on them are never read or answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def settings(settings: Settings, quiet_port: int, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{quiet_port}"),
                        ("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"),
                        ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    return settings.model_copy(update={"result_store": "s3://quiet/results"})


async def test_a_call_held_by_a_quiet_store_fails_as_the_stores_fault(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The upstream sent its whole answer at once; the upload never moved. The call's time
    ran out waiting on the store, which the task says (it said `upstream timed out`, which an
    adaptive endpoint also took as the upstream's refusal)."""
    url = f"{upstream}/quiet"
    await gateway.add_endpoint("quiet", url, timeout_ms=1500, max_retries=0)
    auth = await gateway.new_key()
    await start_dispatcher()
    task = await gateway.submit(auth, url, headers={"X-Mock-Binary": ["1000000;seed=2"]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=30)
    assert done["task_status"] == "failed"
    assert done["task_result"].startswith("result_store_unavailable"), done["task_result"]
    # The store's sweep meets the outage too: a line saying so, not a bug's traceback.
    for _ in range(300):
        said = [r for r in caplog.records if "result store sweep" in r.getMessage()]
        if said:
            break
        await asyncio.sleep(0.1)
    assert said and all(r.levelname == "WARNING" and not r.exc_info for r in said), said
