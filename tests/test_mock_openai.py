"""`qgw mock-upstream --openai` speaks what the official `openai` SDK parses (app/mock_openai.py),
and its controls (refusals, holding calls, the peak in flight) do what tests rely on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.servers import mock_upstream


@pytest.fixture
def mock() -> Iterator[str]:
    with mock_upstream("--openai", "--chunks", "4") as base:
        yield base


def test_chat_embeddings_and_stream_with_usage(mock: str) -> None:
    client = openai.OpenAI(base_url=f"{mock}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "two words"}])
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3"
    assert chat.usage is not None and chat.usage.total_tokens == 2 + 4
    events = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == "tok0 tok1 tok2 tok3 "
    assert events[-1].usage is not None and events[-1].usage.total_tokens == 1 + 4
    emb = client.embeddings.create(model="e", input=["a", "bb"])  # base64, the SDK's default
    assert [len(d.embedding) for d in emb.data] == [8, 8]
    floats = client.embeddings.create(model="e", input="a", encoding_format="float")
    assert floats.data[0].embedding == emb.data[0].embedding


def test_reject_next_then_ok(mock: str) -> None:
    httpx.post(f"{mock}/_mock/config", json={"reject_next": 1}).raise_for_status()
    r = httpx.post(f"{mock}/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.post(f"{mock}/v1/chat/completions", json={"model": "m"}).status_code == 200
    assert httpx.post(f"{mock}/_mock/config", json={"nope": 1}).status_code == 400


async def test_hold_counts_in_flight_and_release(mock: str) -> None:
    async with httpx.AsyncClient(base_url=mock, timeout=10) as http:
        (await http.post("/_mock/config", json={"hold": True})).raise_for_status()
        calls = [asyncio.create_task(http.post("/v1/embeddings", json={"input": "x"}))
                 for _ in range(3)]
        for _ in range(100):
            if (await http.get("/_mock/stats")).json()["in_flight"] == 3:
                break
            await asyncio.sleep(0.05)
        assert not any(c.done() for c in calls)
        (await http.post("/_mock/release")).raise_for_status()
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3
        stats = (await http.get("/_mock/stats")).json()
        assert stats["in_flight"] == 0 and stats["peak_in_flight"] == 3
        (await http.post("/_mock/reset")).raise_for_status()
        assert (await http.get("/_mock/stats")).json()["peak_in_flight"] == 0
