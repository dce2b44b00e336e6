"""Adaptive concurrency (endpoint `concurrency: "adaptive"`, lua/includes/adaptive.lua): the cap
follows the upstream, shared in Redis by every dispatcher."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Gateway
from tests.servers import mock_upstream

Spawn = Callable[..., subprocess.Popen[bytes]]
pytestmark = pytest.mark.backends("single", "cluster")


async def _row(gateway: Gateway, endpoint: str) -> dict[str, Any]:
    r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
    row: dict[str, Any]
    (row,) = [q for q in r.json()["endpoints"] if q["id"] == endpoint]
    return row


async def test_the_cap_learns_what_the_upstream_takes(
    gateway: Gateway, dispatcher_process: Spawn,
) -> None:
    """An upstream that takes 4 calls at once (429 past that) behind a cap of at most 30, two
    dispatchers: adaptive, few calls are refused and the learnt limit shows in the admin view
    and /metrics."""
    await _learn(gateway, dispatcher_process, "adaptive")


@pytest.mark.backends("single")  # the control: what the cap learns in the test above
async def test_a_fixed_cap_of_30_has_most_calls_refused(
    gateway: Gateway, dispatcher_process: Spawn,
) -> None:
    """The same fixed at 30: most calls are refused, and no learnt limit shows. Fewer tasks:
    their calls are refused over and over (40 s of the suite for 150)."""
    await _learn(gateway, dispatcher_process, "fixed", tasks=60)


async def _learn(gateway: Gateway, dispatcher_process: Spawn, concurrency: str,
                 tasks: int = 150) -> None:
    with mock_upstream("--concurrency", "4", "--latency-ms", "100") as base:
        url = f"{base}/learn"
        await gateway.add_endpoint("learn", url, concurrency=concurrency, max_concurrency=30,
                                   max_retries=100, retry_backoff_ms=10)
        auth = await gateway.new_key()
        ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(tasks)]
        dispatcher_process()
        dispatcher_process()
        done = await gateway.wait_finished(auth, ids, timeout=120)
        assert all(d["task_status"] == "completed" for d in done)
        async with httpx.AsyncClient(base_url=base) as mock:
            statuses = (await mock.get("/_mock/stats")).json()["statuses"]
    refused = statuses.get("429", 0) / (statuses.get("429", 0) + statuses["200"])
    row = await _row(gateway, "learn")
    metrics = (await gateway.http.get("/metrics")).text
    if concurrency == "adaptive":
        assert refused < 0.2, statuses
        assert 1 <= row["adaptive_limit"] <= 8, row
        assert f'qgw_endpoint_adaptive_limit{{endpoint="learn"}} {row["adaptive_limit"]}' \
            in metrics
    else:
        assert refused > 0.5, statuses
        assert row["adaptive_limit"] is None
        assert "qgw_endpoint_adaptive_limit{" not in metrics


async def test_the_cap_recovers_after_a_burst_of_failures(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    """503s and timeouts drive the cap to its minimum; once the upstream answers again it
    climbs back (within seconds, well inside 30 s), rather than staying at the minimum."""
    url = f"{fresh_upstream}/heal"
    await gateway.add_endpoint("heal", url, concurrency="adaptive", min_concurrency=1,
                               max_concurrency=20, max_retries=0, timeout_ms=1000)
    auth = await gateway.new_key()
    broken = [(await gateway.submit(auth, url, headers={"X-Mock-Status": ["503"]}))["task_id"]
              for _ in range(20)]
    broken += [(await gateway.submit(auth, url, headers={
        "X-Mock-Latency-Ms": ["3000"]}))["task_id"] for _ in range(5)]
    dispatcher_process()
    await gateway.wait_finished(auth, broken, timeout=60)
    assert (await _row(gateway, "heal"))["adaptive_limit"] == 1
    healed = asyncio.get_running_loop().time()
    ids = [(await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["100"]}))["task_id"]
           for _ in range(400)]
    while (await _row(gateway, "heal"))["adaptive_limit"] < 10:
        assert asyncio.get_running_loop().time() - healed < 30, "the cap stayed low"
        await asyncio.sleep(0.2)
    # The wait estimate counts with the learnt cap: 10 at least, not the minimum of 1.
    status = await gateway.status(auth, ids[-1])
    assert status["wait_time"] < status["wait_num"] * 0.1 / 5 + 2
    await gateway.wait_finished(auth, ids, timeout=60)


@pytest.mark.backends("single")  # the learning itself: the same scripts on a Cluster
async def test_the_cap_climbs_back_after_the_upstream_got_slower_for_good(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    """Calls take 100 ms, then 300 ms for good, however many run: the cap is cut, then the
    base follows the new latency and the cap climbs back within seconds (it stayed at its
    minimum for over a minute: the base stopped following once the figure passed 1.0 while
    the cap in use was still 1, and its slow drift was rounded away)."""
    url = f"{fresh_upstream}/slower"
    await gateway.add_endpoint("slower", url, concurrency="adaptive", min_concurrency=1,
                               max_concurrency=12, max_retries=0)
    auth = await gateway.new_key()
    loop = asyncio.get_running_loop()

    async def feed(latency: int, n: int) -> None:
        for _ in range(n):
            await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": [str(latency)]})

    await feed(100, 300)
    dispatcher_process()
    started = loop.time()
    while (await _row(gateway, "slower"))["adaptive_limit"] < 8:
        assert loop.time() - started < 40, "the cap learnt nothing"
        await asyncio.sleep(0.2)
    feeder = asyncio.create_task(feed(300, 2000))
    try:
        step = loop.time()
        # Cut first: three times slower is what an upstream's own queue looks like.
        while (await _row(gateway, "slower"))["adaptive_limit"] >= 4:
            assert loop.time() - step < 20, "the cap was never cut"
            await asyncio.sleep(0.2)
        cut = loop.time()
        while (await _row(gateway, "slower"))["adaptive_limit"] < 8:
            assert loop.time() - cut < 30, "the cap stayed low"
            await asyncio.sleep(0.2)
        print(f"cut {cut - step:.1f} s after the step, back to 8 {loop.time() - cut:.1f} s later")
    finally:
        feeder.cancel()


async def test_a_call_never_sent_does_not_cut_the_cap(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    """A caller's request that cannot be sent (a control character in a forwarded header)
    fails with no call made: it says nothing of the upstream, so the learnt cap every caller
    shares stays (each such task halved it, as a refusal does)."""
    url = f"{fresh_upstream}/unsent"
    await gateway.add_endpoint("unsent", url, concurrency="adaptive", min_concurrency=1,
                               max_concurrency=16, max_retries=0)
    auth = await gateway.new_key()
    dispatcher_process()
    learnt = asyncio.get_running_loop().time()
    ids = [(await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["50"]}))["task_id"]
           for _ in range(200)]
    while (await _row(gateway, "unsent"))["adaptive_limit"] < 4:
        assert asyncio.get_running_loop().time() - learnt < 30, "the cap learnt nothing"
        await asyncio.sleep(0.2)
    await gateway.wait_finished(auth, ids, timeout=60)
    before = (await _row(gateway, "unsent"))["adaptive_limit"]
    for _ in range(3):
        bad = await gateway.submit(auth, url, headers={"Content-Type": ["a\r\nX-Injected: 1"]})
        (done,) = await gateway.wait_finished(auth, [bad["task_id"]])
        assert done["task_status"] == "failed" and done["result_status_code"] is None
    assert (await _row(gateway, "unsent"))["adaptive_limit"] >= before


async def test_adaptive_needs_a_maximum(gateway: Gateway) -> None:
    for fields in ({"concurrency": "adaptive"},
                   {"concurrency": "adaptive", "max_concurrency": 4, "min_concurrency": 5},
                   {"concurrency": "auto", "max_concurrency": 4}):
        r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin, json={
            "id": "adaptive-bad", "target_url": "http://127.0.0.1:9/x", **fields})
        assert r.status_code == 422, r.text
        assert json.loads(r.text)["error"]["code"]
