"""`wait_time`: the estimate behind it, and what status reports while tasks hold every slot."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from app.endpoints import EndpointConfig
from app.queue.tasks import estimate_wait
from app.runtime import Runtime
from tests.conftest import Gateway


def endpoint(**fields: object) -> EndpointConfig:
    return EndpointConfig.model_validate({"id": "e", "target_url": "http://a/b", **fields})


def test_concurrency_bound_counts_free_slots_and_half_a_gap() -> None:
    ep = endpoint(max_concurrency=4, avg_exec_ms=1000)
    # Measured slot time (800 ms) wins over the configured hint; every slot busy: the task at
    # the head waits for one slot, half a gap (800 / 4 / 2 ms) on average.
    assert estimate_wait(ep, 0, ["500", "800", 4]) == 0.1
    assert estimate_wait(ep, 7, ["500", "800", 4]) == pytest.approx(7.5 * 0.2)
    # Two slots free: the first two in line start at once, the third waits for one.
    assert estimate_wait(ep, 1, [None, "800", 2]) == 0
    assert estimate_wait(ep, 2, [None, "800", 2]) == 0.1
    # Nothing measured yet: avg_exec_ms; a bare exec time (older callers) counts as measured.
    assert estimate_wait(ep, 3, [None, None, 4]) == pytest.approx(3.5 * 0.25)
    assert estimate_wait(ep, 3, "400") == pytest.approx(3.5 * 0.1)


def test_rate_bound_and_the_slower_of_two_limits() -> None:
    assert estimate_wait(endpoint(rate=2, interval_ms=1000), 5, None) == 2.5
    both = endpoint(rate=10, interval_ms=1000, max_concurrency=100)
    assert estimate_wait(both, 50, [None, "1000", 100]) == 5.0  # the rate binds
    assert estimate_wait(endpoint(), 50, [None, None, 0]) == 0  # no limit, idle: at once
    # No limit of its own, but 10 running: the dispatchers' capacity sets the pace.
    assert estimate_wait(endpoint(), 50, [None, "1000", 10]) == pytest.approx(50.5 * 0.1)
    assert estimate_wait(None, 5, None) == 0



def test_an_upstream_pause_is_counted_once() -> None:
    """A claim the pause held writes the pause's end as its `limited_until`: the head of the
    line waits out the pause once, not twice (117 s for a 58 s pause before); a limit that
    holds past the pause holds it till the limit's end. Not honoured, a pause holds nothing."""
    ep = endpoint(max_concurrency=4, avg_exec_ms=1000)
    now, pause_end = 1_000_000, 1_058_000
    measured = [None, None, 0, None, str(pause_end), now, str(pause_end)]
    assert estimate_wait(ep, 0, measured) == 58.0
    later = [None, None, 0, None, str(pause_end), now, str(pause_end + 5000)]
    assert estimate_wait(ep, 0, later) == 63.0
    # A rate of 1 a minute, last admitted 2 s ago: its next admission is within the pause.
    paced = endpoint(rate=1, interval_ms=60_000)
    assert estimate_wait(paced, 0, [None, None, 0, str(now - 2000), str(pause_end), now,
                                    str(pause_end)]) == 58.0
    off = endpoint(max_concurrency=4, avg_exec_ms=1000, honor_upstream_limits=False)
    assert estimate_wait(off, 0, [None, None, 0, None, str(pause_end), now, None]) == 0

async def test_status_reports_the_wait_behind_busy_slots(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/busy"
    await gateway.add_endpoint("busy", url, max_concurrency=2, avg_exec_ms=3000)
    auth = await gateway.new_key()
    slow = {"X-Mock-Latency-Ms": ["1500"]}
    tasks = [await gateway.submit(auth, url, headers=slow) for _ in range(4)]
    before = await gateway.status(auth, tasks[3]["task_id"])
    # Nothing in flight yet: two slots free, so the 4th waits for 2 of them: 1.5 gaps of 1.5 s.
    # The answers carry whole seconds, rounded up (2.25 -> 3).
    assert before["wait_num"] == 3 and before["wait_time"] == 3
    # Submit answers with the same estimate (the first two start at once).
    assert [t["wait_time"] for t in tasks] == [0, 0, 1, 3]
    await start_dispatcher()
    for _ in range(100):
        s = await gateway.status(auth, tasks[3]["task_id"])
        if s["wait_num"] == 1:
            break
        await asyncio.sleep(0.02)
    # Both slots busy, one task ahead: two slots must come back first.
    assert s["wait_num"] == 1 and s["wait_time"] == 3  # 2.25 s
    await gateway.wait_finished(auth, [t["task_id"] for t in tasks])


def test_a_further_limit_slower_than_the_main_one_sets_the_pace() -> None:
    """3/s and 100/min: 200 tasks ahead wait for the minute limit, 2 minutes, not 67 s."""
    ep = endpoint(rate=3, interval_ms=1000, limits=[
        {"limiter": "sliding_window", "rate": 100, "interval_ms": 60_000}])
    assert estimate_wait(ep, 200, [None, None, 0]) == pytest.approx(120)
    assert estimate_wait(ep, 2, [None, None, 0]) == pytest.approx(2 / 3, abs=0.01)
