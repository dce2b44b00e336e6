"""Bounded starvation (endpoint `max_starvation_s`, lua/includes/starvation.lua): a task
waiting longer than the bound is served before higher priorities."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest

from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")
FLOOD = 5000


def _ms(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000


async def test_a_flood_of_high_priorities_delays_a_low_one_by_at_most_the_bound(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """A priority-0 task, then 5,000 of priority 9 (200/s: 25 s of work): it starts once it
    has waited the bound, ahead of the thousands of priority 9 still waiting (without the
    bound it would start last, after all of them)."""
    url = f"{fresh_upstream}/starve"
    await gateway.add_endpoint("starve", url, rate=200, paused=True, max_starvation_s=3600)
    auth = await gateway.new_key()
    low = await gateway.submit(auth, url, priority=0)
    began = time.monotonic()
    # Started now, while the endpoint is paused: its start-up (seconds on a busy machine)
    # must not count against the bound measured below.
    dispatcher_process()

    async def flood(n: int) -> None:
        for _ in range(n):
            await gateway.submit(auth, url, priority=9)

    await asyncio.gather(*(flood(FLOOD // 25) for _ in range(25)))
    # The bound: a few seconds past the time the flood took to submit, while it is all
    # still waiting (the endpoint was paused until now).
    bound = math.ceil(time.monotonic() - began) + 3
    r = await gateway.http.patch("/admin/v1/endpoints/starve", headers=gateway.admin,
                                 json={"paused": False, "max_starvation_s": bound})
    assert r.status_code == 200, r.text
    for _ in range(300):
        status = await gateway.status(auth, low["task_id"])
        if status["task_status"] != "pending":
            break
        await asyncio.sleep(0.1)
    waited = _ms(status["started_at"]) - _ms(status["created_at"])
    assert bound * 1000 - 100 <= waited <= bound * 1000 + 2500, (bound, waited)
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        log = (await mock.get("/_mock/log")).json()
    served_before = [e["idempotency_key"] for e in log].index(low["task_id"])
    assert 100 <= served_before <= FLOOD - 1000  # priority held until then, not after


async def test_the_bound_is_checked(gateway: Gateway) -> None:
    for bad in (0, -1, 86_401, "5"):
        r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin, json={
            "id": "starve-bad", "target_url": "http://127.0.0.1:9/x", "max_starvation_s": bad})
        assert r.status_code == 422 and "max_starvation_s" in r.json()["error"]["message"]
