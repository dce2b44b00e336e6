"""The official `openai` SDK through the drop-in proxy: only its base URL and key change."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import Gateway
from tests.servers import mock_log
from tests.test_proxy import StartApi, StartDispatcher, mock_stats, openai_server, proxied

__all__ = ["openai_server"]  # the module's mock, shared with tests/test_proxy.py
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def llm(openai_server: str) -> str:
    httpx.post(f"{openai_server}/_mock/reset").raise_for_status()
    return openai_server


async def sdk_setup(gateway: Gateway, llm: str, start_api: StartApi,
                    start_dispatcher: StartDispatcher, **fields: Any) -> tuple[str, str]:
    auth = await proxied(gateway, llm, **fields)
    base = await start_api()
    await start_dispatcher()
    return f"{base}/proxy/llm", auth["Authorization"].removeprefix("Bearer ")


@pytest.mark.backends("single", "cluster")
async def test_chat_stream_and_embeddings(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    base_url, key = await sdk_setup(gateway, llm, start_api, start_dispatcher)

    def drive() -> tuple[Any, list[Any], Any]:
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        chat = client.chat.completions.create(model="m", messages=HI)
        events = list(client.chat.completions.create(
            model="m", messages=HI, stream=True,
            stream_options={"include_usage": True}))
        emb = client.embeddings.create(model="e", input=["a", "b c"])
        return chat, events, emb

    chat, events, emb = await asyncio.to_thread(drive)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == \
        "tok0 tok1 tok2 tok3 tok4 "
    assert events[-1].usage.total_tokens == 2 + 5
    assert [len(d.embedding) for d in emb.data] == [8, 8]
    log = mock_log(llm)
    assert [e["path"] for e in log] == ["/v1/chat/completions"] * 2 + ["/v1/embeddings"]
    assert all(cast("dict[str, str]", e["headers"]).get("authorization") is None for e in log)


@pytest.mark.backends("single", "cluster")
async def test_429_then_ok_goes_back_in_line(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    base_url, key = await sdk_setup(gateway, llm, start_api, start_dispatcher)
    httpx.post(f"{llm}/_mock/config", json={"reject_next": 1}).raise_for_status()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=HI)
    assert raw.http_response.status_code == 200  # the caller never saw the 429
    content = raw.parse().choices[0].message.content
    assert content is not None and content.startswith("tok0")
    first, second = mock_log(llm)
    assert (first["status"], second["status"]) == (429, 200)
    # The endpoint paused for the second the upstream asked (to the clock's next whole second,
    # app/queue/signals.py), then the same task went again.
    assert float(second["t"]) >= (float(first["t"]) // 1000 + 1) * 1000  # type: ignore[arg-type]
    assert first["idempotency_key"] == second["idempotency_key"]
    view = await gateway.status({"Authorization": f"Bearer {key}"},
                                raw.headers["x-queue-task-id"])
    assert view["task_status"] == "completed" and view["attempts"] == 2


@pytest.mark.backends("single", "cluster")
async def test_priority_order_behind_a_held_upstream(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    base_url, key = await sdk_setup(gateway, llm, start_api, start_dispatcher,
                                    max_concurrency=1)
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)

    async def ask(name: str, priority: int) -> str:
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": name}],
            extra_headers={"X-Queue-Priority": str(priority)})
        return r.id

    first = asyncio.create_task(ask("first", 0))
    await _until(lambda: mock_stats(llm)["in_flight"] == 1)
    rest = []
    for name, priority in (("low", 1), ("high", 5), ("mid", 3)):
        rest.append(asyncio.create_task(ask(name, priority)))
        await asyncio.sleep(0.3)  # each is in line before the next comes
    httpx.post(f"{llm}/_mock/release").raise_for_status()
    await asyncio.gather(first, *rest)
    order = [e["body"] for e in mock_log(llm)]
    assert [next(n for n in ("first", "low", "high", "mid") if n in str(b)) for b in order] == \
        ["first", "high", "mid", "low"]


@pytest.mark.backends("single", "cluster")
async def test_closing_the_stream_aborts_the_call_and_frees_the_slot(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    base_url, key = await sdk_setup(gateway, llm, start_api, start_dispatcher,
                                    max_concurrency=1)
    httpx.post(f"{llm}/_mock/config", json={"chunks": 100, "chunk_ms": 100}).raise_for_status()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    stream = await client.chat.completions.create(model="m", messages=HI, stream=True)
    async for _ in stream:
        break
    task_id = stream.response.headers["x-queue-task-id"]
    await stream.close()
    closed = time.monotonic()
    await _until(lambda: mock_stats(llm)["in_flight"] == 0)
    assert time.monotonic() - closed < 1.0  # the upstream's call was cut at once
    # The slot is free: the next call (cap 1) goes through without waiting for a lease.
    httpx.post(f"{llm}/_mock/config", json={"chunks": 2, "chunk_ms": 0}).raise_for_status()
    r = await client.chat.completions.with_raw_response.create(
        model="m", messages=HI)
    assert int(r.headers["x-queue-waited-ms"]) < 1000
    auth = {"Authorization": f"Bearer {key}"}
    view = await gateway.status(auth, task_id)
    assert view["task_status"] == "failed" and view["task_result"] == "caller connection lost"


async def _until(check: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)
