"""A call the upstream refused with a pause costs its task nothing: back to its place in line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from app.core.keys import Keys
from app.endpoints import EndpointConfig
from app.queue import acks, claims
from app.queue.signals import ALIGN_MARGIN_S, pause_s, remaining
from tests.conftest import Gateway

Spawn = Callable[..., subprocess.Popen[bytes]]
pytestmark = pytest.mark.backends("single", "cluster")
REFUSAL = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "250ms"}


async def test_a_refused_call_waits_only_for_the_pause_and_spends_no_attempt(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    """Five calls refused at once with a 0.25 s reset: all done just after it, each on its
    first attempt, though a retry's own back-off (retry_backoff_ms 3000) is 1.5 to 3 s."""
    url = f"{fresh_upstream}/refused"
    await gateway.add_endpoint("refused", url, max_concurrency=5, retry_backoff_ms=3000,
                               max_retries=1)
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url, headers={
        "X-Mock-Status": ["429"], "X-Mock-Status-Times": ["1"],
        "X-Mock-Reply-Headers": [json.dumps(REFUSAL)]}))["task_id"] for _ in range(5)]
    dispatcher_process()
    done = await gateway.wait_finished(auth, ids, timeout=30)
    assert [d["task_status"] for d in done] == ["completed"] * 5
    assert [d["attempts"] for d in done] == [1] * 5  # the refusals spent none
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        log = (await mock.get("/_mock/log")).json()
    refused = [e["t"] for e in log if e["status"] == 429]
    served = [e["t"] for e in log if e["status"] == 200]
    assert len(refused) == 5 and len(served) == 5
    # The pause held them (nothing before it ended), and nothing more: the probe first, then
    # the four others, all within a second of the refusals (3.7 s before).
    assert min(served) - min(refused) >= 240
    assert max(served) - min(refused) < 1000


def test_what_remains_is_read_from_the_request_counts() -> None:
    now = 1_800_000_000.2
    assert remaining({"x-ratelimit-remaining-requests": "7",
                      "x-ratelimit-reset-requests": "250ms"}, now) == (7, 0.25)
    # The lowest count of several; a token count is no count of calls; no reset, no count.
    assert remaining({"x-ratelimit-remaining": "9", "x-ratelimit-reset": "2",
                      "ratelimit-remaining": "3", "ratelimit-reset": "2"},
                     now) == (3, pytest.approx(1.8 + ALIGN_MARGIN_S))  # type: ignore[comparison-overlap]  # approx == float
    assert remaining({"x-ratelimit-remaining-tokens": "1",
                      "x-ratelimit-reset-tokens": "1s"}, now) is None
    assert remaining({"x-ratelimit-remaining-requests": "4"}, now) is None
    # Latin-1 bytes such as \xb2 (`²`) pass str.isdigit but not int(): no signal, no error.
    assert remaining({"x-ratelimit-remaining": "\u00b2", "x-ratelimit-reset": "\u00b2"},
                     now) is None
    assert pause_s(429, {"retry-after": "\u00b2"}, now) is None
    assert pause_s(429, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "\u00b2"},
                   now) is None


def test_a_pause_counts_from_the_answer_not_from_a_late_try(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ack (or a retry's setting aside) retried through a Redis outage sends what is left
    of the pause its answer asked for: started again from the late try, it held the endpoint
    the outage's length longer. Spent meanwhile, one ms is left: the probe still goes first."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    assert claims.pause_left_ms(0, 990.0) == 0  # none asked
    assert claims.pause_left_ms(5000, 998.0) == 3000
    assert claims.pause_left_ms(5000, 900.0) == 1
    ack = acks._Ack(cast(Any, None), ["t", "tok", "completed", "", 429, 12, 5000, "", ""],
                    cast(Any, None), answered=now[0])
    now[0] += 2.0
    assert ack.current()[6] == 3000 and ack.values[6] == 5000


async def test_an_ack_retried_through_an_outage_sends_what_is_left_of_its_pause() -> None:
    """Each try of an ack that met an outage is built anew: the last one carries the pause
    less the time the outage took (built once, every try carried the whole pause)."""
    sent: list[int] = []

    async def ack(keys: list[str], args: list[Any]) -> list[int]:
        sent.append(int(args[-3]))  # the pause: seventh of the ack's nine values
        if len(sent) < 3:
            raise RedisConnectionError("away")
        return [0, 1]

    ep = EndpointConfig.model_validate({"id": "e", "target_url": "http://a/b"})
    disp = SimpleNamespace(keys=Keys(), settings=SimpleNamespace(rate_guard_ms=200),
                           scripts=SimpleNamespace(ack=ack), _done=lambda claim: None,
                           backlog={})
    batch = acks.AckBatch(cast(Any, disp))
    item = acks._Ack(cast(Any, SimpleNamespace(endpoint=ep, task_id="t.e")),
                     ["t.e", "tok", "failed", "", 429, 12, 60_000, "", ""],
                     asyncio.get_running_loop().create_future())
    await batch._one([item])
    assert item.result.result() == 1 and len(sent) == 3
    assert sent[0] <= 60_000 and sent[2] < sent[0] - 100  # the back-off between tries


async def test_no_more_calls_than_the_upstream_said_remain_before_its_reset(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    """An answer says 2 calls remain for 1.5 s: of six tasks waiting, two go, the others once
    the reset has passed (before, all six went at once and four were refused)."""
    url = f"{fresh_upstream}/remaining"
    await gateway.add_endpoint("remaining", url, max_concurrency=10)
    auth = await gateway.new_key()
    first = (await gateway.submit(auth, url, headers={"X-Mock-Reply-Headers": [json.dumps(
        {"x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "1500ms"})]}))
    dispatcher_process()
    await gateway.wait_finished(auth, [first["task_id"]])
    ids = [(await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["100"]}))["task_id"]
           for _ in range(6)]
    done = await gateway.wait_finished(auth, ids, timeout=30)
    assert [d["task_status"] for d in done] == ["completed"] * 6
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        log = (await mock.get("/_mock/log")).json()
    told, *rest = [e["t"] for e in log]
    assert len(rest) == 6
    assert sum(1 for t in rest if t < told + 1450) == 2
    assert sum(1 for t in rest if t < told + 2500) == 6  # then at once
