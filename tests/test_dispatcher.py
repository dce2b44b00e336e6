"""The dispatcher's wake-ups: a backlog never waits on the reaper's nudge."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Gateway
from tests.servers import TLS
from tests.test_ratelimit import most_in_window

TASKS = 3000


async def test_a_backlog_never_stalls_when_the_dispatchers_share_is_full(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Woken while its share of the process is taken (3 of 4 slots, against a cap of 10), an
    endpoint is claimed again as soon as a slot frees, not at the reaper's next nudge (10 s
    here). Before the fix, 2 runs in 4 paused 2-3 s with a 3 s nudge."""
    arrivals = await _backlog_arrivals(gateway, fresh_upstream, dispatcher_process, TASKS,
                                       "4", max_concurrency=10)
    gap = max(b - a for a, b in itertools.pairwise(arrivals))
    # Calls take ~1 ms; anything near a second is a lost wake-up, not a busy machine.
    assert gap < 500, f"dispatch paused {gap:.0f} ms with a backlog waiting"


@pytest.mark.parametrize(("process_slots", "endpoint_cap"),
                         [("1", 0), ("2", 2), ("16", 10), ("64", 50)],
                         ids=["1-slot", "2-slots", "10-slots", "50-slots"])
async def test_a_backlog_never_waits_50_ms_for_dispatch_at_any_capacity(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
    process_slots: str, endpoint_cap: int,
) -> None:
    """With a backlog waiting and a no-op upstream, one call starts right after another ends,
    whether the process's share (1, 2 and 50 slots) or the endpoint's cap in Redis (10) is what
    fills up; a lost wake-up waits for the reaper's nudge (10 s here). A process of one slot
    has a share of one (was 0: it claimed nothing)."""
    arrivals = await _backlog_arrivals(gateway, fresh_upstream, dispatcher_process, 1000,
                                       process_slots, max_concurrency=endpoint_cap)
    # The steady part: not the start-up (connections opening, scripts loading) nor the tail.
    steady = arrivals[100:-20]
    gaps = sorted(b - a for a, b in itertools.pairwise(steady))
    # A loaded 2-core machine (load 4-5 here) takes the CPU away now and then: one run in 7
    # saw 5 gaps of 56-200 ms among 880. A lost wake-up waits for the nudge (10 s), a claim
    # that stalls repeats: the longest gap stays far under the nudge, and 99 in 100 under 50.
    assert gaps[-1] < 250, f"dispatch paused {gaps[-1]:.0f} ms with a backlog waiting"
    slow = [round(g) for g in gaps if g >= 50]
    assert len(slow) <= len(gaps) // 100, f"dispatch paused {slow} ms with a backlog waiting"


async def _backlog_arrivals(
    gateway: Gateway, upstream: str, dispatcher_process: Callable[..., subprocess.Popen[bytes]],
    tasks: int, process_slots: str, queued: Callable[[], Awaitable[Any]] | None = None,
    **endpoint: Any,
) -> list[float]:
    """Queue `tasks` no-op calls (then await `queued()`), start a dispatcher of `process_slots`
    and return when each call reached the upstream (ms, sorted)."""
    await gateway.add_endpoint("stall", f"{upstream}/stall", **endpoint)
    auth = await gateway.new_key()
    for _ in range(tasks):
        await gateway.submit(auth, f"{upstream}/stall")
    if queued is not None:
        await queued()
    dispatcher_process(QGW_DISPATCH_CONCURRENCY=process_slots, QGW_REAP_INTERVAL_MS="10000")
    async with httpx.AsyncClient(base_url=upstream, verify=TLS) as mock:
        for _ in range(240):
            await asyncio.sleep(0.25)
            if (await mock.get("/_mock/stats")).json()["received"] >= tasks:
                break
        arrivals = sorted(e["t"] for e in (await mock.get("/_mock/log")).json())
    assert len(arrivals) == tasks
    return arrivals


@pytest.mark.parametrize(("latency_ms", "slots"), [(20, 8), (300, 6)], ids=["quick", "slow"])
async def test_an_endpoint_alone_takes_every_slot_only_while_its_calls_are_quick(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
    latency_ms: int, slots: int,
) -> None:
    """Alone in a process of 8 slots, an endpoint whose calls end within LEND_MS (50 ms) has
    all 8 (it had 6, its share, the other 2 kept for nobody); one with slow calls keeps to its
    share, so the slots another endpoint needs are free or free soon. Either way, another
    endpoint's tasks submitted meanwhile start at once, not behind the backlog."""
    hog, other = f"{fresh_upstream}/hog", f"{fresh_upstream}/other"
    latency = {"X-Mock-Latency-Ms": [str(latency_ms)]}
    await gateway.add_endpoint("hog", hog)
    await gateway.add_endpoint("other", other)
    auth = await gateway.new_key()
    backlog = 5_000 // latency_ms * slots  # 5 s of calls
    for _ in range(backlog):
        await gateway.submit(auth, hog, headers=latency)
    dispatcher_process(QGW_DISPATCH_CONCURRENCY="8")
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        for _ in range(200):  # until the backlog is well under way (bounded: 10 s)
            if (await mock.get("/_mock/stats")).json()["received"] >= 5 * slots:
                break
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        came = loop.time()
        ids = [(await gateway.submit(auth, other))["task_id"] for _ in range(4)]
        await gateway.wait_finished(auth, ids, timeout=8)
        waited = loop.time() - came
        log = (await mock.get("/_mock/log")).json()
    hogs = sorted(e["t"] for e in log if e["path"] == "/hog")
    # Each call holds its slot for latency_ms: no more than the slots it has in a window
    # shorter than that.
    assert most_in_window(hogs, latency_ms * 0.8) == slots
    assert waited < 2.0, f"the other endpoint waited {waited:.1f} s behind the backlog"
    assert len(hogs) < backlog  # the backlog was still there


@pytest.mark.backends("single", "cluster")  # the retry set and its wake-ups on both
async def test_a_task_waiting_to_retry_frees_its_slot(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """One slot: while the failing task waits out its 1.5 s back-off, the next one runs."""
    url = f"{fresh_upstream}/retry-slot"
    await gateway.add_endpoint("retry-slot", url, max_concurrency=1, max_retries=1,
                               retry_backoff_ms=1500)
    auth = await gateway.new_key()
    failing = await gateway.submit(auth, url, headers={"X-Mock-Status": ["500"]})
    behind = await gateway.submit(auth, url)
    dispatcher_process()
    a, b = await gateway.wait_finished(auth, [failing["task_id"], behind["task_id"]])
    assert (a["task_status"], a["attempts"], b["task_status"]) == ("failed", 2, "completed")
    assert b["ended_at"] < a["ended_at"]  # before: it waited for both of the other's attempts
    calls = [e["idempotency_key"] for e in await _mock_log(fresh_upstream)]
    assert calls == [failing["task_id"], behind["task_id"], failing["task_id"]]


@pytest.mark.backends("single", "cluster")  # the retry set and its wake-ups on both
async def test_kill_9_while_a_task_waits_to_retry_loses_nothing(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """The back-off lives in Redis: a dispatcher killed during it costs nothing, and the next
    attempt still waits for it."""
    url = f"{fresh_upstream}/retry-kill"
    await gateway.add_endpoint("retry-kill", url, max_retries=1, retry_backoff_ms=2000)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, url, headers={"X-Mock-Status": ["503"]})
    first = dispatcher_process()
    for _ in range(100):
        if await _mock_log(fresh_upstream):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # its retry set aside (due in 1-2 s)
    first.send_signal(signal.SIGKILL)
    first.wait()
    status = await gateway.status(auth, task["task_id"])
    assert (status["task_status"], status["attempts"]) == ("pending", 1)
    assert 0 < status["wait_time"] <= 2  # until its back-off is over
    dispatcher_process()
    (done,) = await gateway.wait_finished(auth, [task["task_id"]])
    log = await _mock_log(fresh_upstream)
    assert (done["task_status"], done["attempts"], len(log)) == ("failed", 2, 2)
    assert log[1]["t"] - log[0]["t"] >= 1000  # the back-off's least (2 s, jittered)


async def _mock_log(base: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, verify=TLS) as mock:
        log: list[dict[str, Any]] = (await mock.get("/_mock/log")).json()
    return log


async def test_acks_of_a_backlog_share_round_trips_with_the_next_claims(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Calls that end together are acknowledged in one pipeline, with the claim of the slots
    they free behind them (app/queue/acks.py), instead of an ack, a wake marker popped and a
    claim for each: Redis reads fewer requests than tasks (before: 1.51 a task, after: 0.32)."""
    redis, tasks, before = gateway.rt.redis, 1000, []

    async def queued() -> None:
        before.append(await _reads(redis))

    await _backlog_arrivals(gateway, fresh_upstream, dispatcher_process, tasks, "16",
                            queued, max_concurrency=10)
    per_task = (await _reads(redis) - before[0]) / tasks
    assert per_task < 1.0, f"{per_task:.2f} Redis reads a task"


async def _reads(redis: Any) -> int:
    """Requests Redis has read from its clients so far (a pipeline is one read)."""
    stats = await redis.info("stats")
    return int(stats["total_reads_processed"])
