"""Upstream rate-limit signals pause the endpoint on every dispatcher; one probe reopens it."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from app.queue.signals import ALIGN_MARGIN_S, pause_s, reset_s
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import TLS
from tests.test_metrics import scrape, value

Spawn = Callable[..., subprocess.Popen[bytes]]
# The pause, the probe and their scripts on both (the tests without Redis run once).
pytestmark = pytest.mark.backends("single", "cluster")


def test_the_common_header_forms_are_read() -> None:
    now = 1_800_000_000.0
    assert reset_s("1m30.5s", now) == 90.5 and reset_s("20ms", now) == 0.02
    assert reset_s("6m0s", now) == 360 and reset_s("2", now) == 2
    assert reset_s(str(now + 7), now) == 7  # a unix time
    assert reset_s("2027-01-15T08:00:07Z", 1_800_000_000.0) is not None
    assert reset_s("soon", now) is None
    assert pause_s(429, {"retry-after": "3"}, now) == 3 + ALIGN_MARGIN_S  # now: a whole second
    assert pause_s(500, {"retry-after": "3"}, now) is None  # only 429 and 503 ask for a pause
    assert pause_s(200, {"x-ratelimit-remaining-tokens": "0",
                         "x-ratelimit-reset-tokens": "1.5s"}, now) == 1.5
    assert pause_s(200, {"x-ratelimit-remaining-requests": "4",
                         "x-ratelimit-reset-requests": "9s"}, now) is None
    assert pause_s(200, {"anthropic-ratelimit-requests-remaining": "0",
                         "anthropic-ratelimit-requests-reset": str(now + 12)}, now) == 12


def test_a_wait_in_whole_seconds_ends_at_the_second_it_was_rounded_up_from() -> None:
    """`Retry-After: 1` 0.2 s into a second of the clock means the next whole second, 0.8 s
    away, not 1.2 s; a precise reset given beside it is the same wait, told better."""
    now = 1_800_000_000.2
    at_second = 0.8 + ALIGN_MARGIN_S
    assert pause_s(429, {"retry-after": "1"}, now) == pytest.approx(at_second)
    assert pause_s(200, {"x-ratelimit-remaining-requests": "0",
                         "x-ratelimit-reset-requests": "1s"}, now) == pytest.approx(at_second)
    assert pause_s(429, {"retry-after": "1", "x-ratelimit-remaining-requests": "0",
                         "x-ratelimit-reset-requests": "790ms"}, now) == pytest.approx(0.79)
    # A longer precise wait is another limit's: it still holds.
    assert pause_s(429, {"retry-after": "1", "x-ratelimit-remaining-tokens": "0",
                         "x-ratelimit-reset-tokens": "2.5s"}, now) == 2.5
    six_minutes = {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s"}
    assert pause_s(200, six_minutes, now) == pytest.approx(359.8 + ALIGN_MARGIN_S)


async def _log(base: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, verify=TLS) as mock:
        log: list[dict[str, Any]] = (await mock.get("/_mock/log")).json()
    return log


async def _run(gateway: Gateway, base: str, spawn: Spawn, honor: bool,
               signal: dict[str, str], status: int) -> tuple[str, list[dict[str, Any]]]:
    """Two dispatchers, 4 slots: the first call answers `signal`; 8 more come just after."""
    url = f"{base}/signal"
    await gateway.add_endpoint("signal", url, max_concurrency=4, retry_backoff_ms=100,
                               honor_upstream_limits=honor)
    auth = await gateway.new_key()
    # A 429 three times, then a success taking 200 ms (a refusal costs nothing: its task goes
    # back in line, so one refused for ever would be refused until its free refusals ran out).
    first = await gateway.submit(auth, url, headers={
        "X-Mock-Status": [str(status)], "X-Mock-Reply-Headers": [json.dumps(signal)],
        "X-Mock-Status-Times": ["3"], "X-Mock-Latency-Ms": ["200"]})
    spawn()
    spawn()
    for _ in range(200):
        if await _log(base):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # its answer read
    rest = [(await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["200"]}))["task_id"]
            for _ in range(8)]
    await gateway.wait_finished(auth, [first["task_id"], *rest], timeout=30)
    return first["task_id"], await _log(base)


def _waited(signal_ms: float, next_ms: float) -> bool:
    """The next call came right after the whole second a whole-seconds "2" counted to."""
    return 1000 <= next_ms - signal_ms <= 2400 and 10 <= next_ms % 1000 <= 400


@pytest.mark.parametrize(("status", "signal"), [
    (429, {"Retry-After": "2"}),
    (200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"}),
])
async def test_a_signal_pauses_every_dispatcher_then_one_probe_goes_first(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn, status: int,
    signal: dict[str, str],
) -> None:
    first, log = await _run(gateway, fresh_upstream, dispatcher_process, True, signal, status)
    signalled = [e["t"] for e in log if e["idempotency_key"] == first]
    after = [e["t"] for e in log if e["idempotency_key"] != first]
    # A 429'd task goes back to its place in line, first, and goes again when the pause ends,
    # as the probe, which pauses it again each time (3 refusals, then its success); nothing
    # else reaches the upstream, on either dispatcher, until the whole second of the clock
    # that each signal's "2" (2 s, rounded up) counts to: 1 to 2 s later.
    assert len(signalled) == (4 if status == 429 else 1)
    probe = signalled[-1] if status == 429 else after.pop(0)
    tries = signalled if status == 429 else [*signalled, probe]
    assert all(_waited(a, b) for a, b in itertools.pairwise(tries))
    # Then one call alone, and the rest only once it has succeeded (each takes 200 ms), 4 at a
    # time again.
    assert min(after) - probe >= 190
    assert sum(1 for t in after if t - after[0] < 100) == 4
    # Each task's wait in line counts once, at its first start: not again at each start after
    # a refusal given back (measured from its submit, those took in the earlier calls too).
    assert value(await scrape(gateway), "qgw_queue_wait_seconds_count", "signal") == 9


@pytest.mark.backends("single")  # no script of its own: the flag only skips the pause
async def test_signals_are_ignored_when_the_endpoint_says_so(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    started = time.time() * 1000
    _, log = await _run(gateway, fresh_upstream, dispatcher_process, False,
                        {"Retry-After": "5"}, 429)
    # The others go at once, 4 at a time; the 429'd task itself still waits its Retry-After.
    assert log[1]["t"] - log[0]["t"] < 1500
    assert sum(1 for e in log[1:5] if e["t"] - log[1]["t"] < 100) == 4
    assert time.time() * 1000 - started > 5000


async def test_turning_the_signals_off_lifts_a_pause_or_budget_they_set(
    gateway: Gateway, fresh_upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    """An answer asks for no more calls for 10 minutes (none left till the reset); the operator
    turns `honor_upstream_limits` off: the next task goes at once, and the view shows no pause
    (the claim read the pause whatever the flag said)."""
    url = f"{fresh_upstream}/unheld"
    await gateway.add_endpoint("unheld", url)
    auth = await gateway.new_key()
    await start_dispatcher()
    first = await gateway.submit(auth, url, headers={"X-Mock-Reply-Headers": [json.dumps({
        "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "10m0s"})]})
    await gateway.wait_finished(auth, [first["task_id"]])
    held = await gateway.submit(auth, url)
    await asyncio.sleep(0.5)
    assert (await gateway.status(auth, held["task_id"]))["task_status"] == "pending"
    r = await gateway.http.patch("/admin/v1/endpoints/unheld", headers=gateway.admin,
                                 json={"honor_upstream_limits": False})
    assert r.status_code == 200, r.text
    await gateway.submit(auth, url)  # a submit wakes the endpoint's claim
    (done,) = await gateway.wait_finished(auth, [held["task_id"]], timeout=10)
    assert done["task_status"] == "completed"
    # Nor does the estimate count what the pause held the line till (600 s): one that must
    # start within 30 s is taken.
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": url, "max_wait_s": 30})
    assert r.status_code == 202, r.text
    r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
    (row,) = [q for q in r.json()["endpoints"] if q["id"] == "unheld"]
    assert row["upstream_paused_until"] is None and row["binding_limit"] != "upstream"


async def test_the_pause_shows_in_the_admin_view(
    gateway: Gateway, fresh_upstream: str, dispatcher_process: Spawn,
) -> None:
    url = f"{fresh_upstream}/shown"
    await gateway.add_endpoint("shown", url)
    auth = await gateway.new_key()
    await gateway.submit(auth, url, headers={
        "X-Mock-Status": ["429"], "X-Mock-Reply-Headers": [json.dumps({"Retry-After": "30"})]})
    dispatcher_process()
    for _ in range(100):
        r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
        (row,) = [q for q in r.json()["endpoints"] if q["id"] == "shown"] or [None]
        if row and row.get("upstream_paused_until"):
            break
        await asyncio.sleep(0.1)
    assert row and row["upstream_paused_until"]
    # The 429'd task waits to retry; a second one waits in line behind the pause.
    await gateway.submit(auth, url)
    r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
    (row,) = [q for q in r.json()["endpoints"] if q["id"] == "shown"]
    assert row["binding_limit"] == "upstream" and row["admits_next_at"]
    m = (await gateway.http.get("/metrics")).text
    assert 'qgw_endpoint_upstream_paused{endpoint="shown"} 1' in m


async def _processing(gateway: Gateway, auth: dict[str, str], ids: list[str]) -> list[str]:
    return [t for t in ids if (await gateway.status(auth, t))["task_status"] == "processing"]


@pytest.mark.parametrize("end", ["complete", "cancel"])
async def test_an_online_probe_ends_when_its_caller_completes_or_cancels_it(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    end: str,
) -> None:
    """A mixed endpoint paused by an offline call's signal: after the pause one online task gets
    its permit alone, as the probe. Its `complete` lifts the pause, and the others are admitted
    at once; cancelled, it lifts nothing, and the next one probes at once. Neither waits for
    the probe's permit (30 s) to run out."""
    url = f"{upstream}/mixed"
    await gateway.add_endpoint("mixed", url, max_retries=0, permit_ttl_s=30)
    auth = await gateway.new_key()
    signal = await gateway.submit(auth, url, headers={"X-Mock-Reply-Headers": [json.dumps(
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"})]})
    await start_dispatcher()
    await gateway.wait_finished(auth, [signal["task_id"]])
    online = [(await gateway.submit(auth, url, task_type="online"))["task_id"] for _ in range(3)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not (admitted := await _processing(gateway, auth, online)):
        assert loop.time() < deadline, "no probe after the pause"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert await _processing(gateway, auth, online) == admitted  # the probe goes alone
    (probe,) = admitted
    r = await gateway.http.post(f"/api/v1/tasks/{probe}/{end}", headers=auth)
    assert r.status_code == 200, r.text
    rest = [t for t in online if t != probe]
    want = len(rest) if end == "complete" else 1  # reopened, or the next probe alone
    deadline = loop.time() + 3
    while len(await _processing(gateway, auth, rest)) < want:
        assert loop.time() < deadline, f"nothing admitted after the probe's {end}"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert len(await _processing(gateway, auth, rest)) == want
    row = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
    (shown,) = [q for q in row.json()["endpoints"] if q["id"] == "mixed"]
    assert bool(shown.get("upstream_paused_until")) == (end == "cancel")


@pytest.mark.parametrize("how", ["handed back", "reaped"])
async def test_a_probe_handed_back_or_reaped_lets_another_go(
    gateway: Gateway, upstream: str, dispatcher_process: Spawn, how: str,
) -> None:
    """The dispatcher calling the probe stops (SIGTERM: it hands the task back) or dies
    (kill -9: the reaper returns it when its lease runs out): the other dispatcher probes
    again then, not when the probe's key (as long as a 30 s permit) expires."""
    url = f"{upstream}/handback"
    await gateway.add_endpoint("handback", url, permit_ttl_s=30)
    auth = await gateway.new_key()
    signal = await gateway.submit(auth, url, headers={"X-Mock-Reply-Headers": [json.dumps(
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"})]})
    first = dispatcher_process(QGW_SHUTDOWN_GRACE_S="0")
    await gateway.wait_finished(auth, [signal["task_id"]])
    slow = (await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["5000"]}))["task_id"]

    async def calls() -> list[float]:
        return [e["t"] for e in await _log(upstream) if e["idempotency_key"] == slow]

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not await calls():  # the probe, after the pause
        assert loop.time() < deadline, "no probe after the pause"
        await asyncio.sleep(0.05)
    dispatcher_process(QGW_SHUTDOWN_GRACE_S="0")
    await asyncio.sleep(1)  # the second one up, held behind the probe
    assert len(await calls()) == 1
    if how == "reaped":
        first.kill()
    else:
        first.terminate()
    await asyncio.to_thread(first.wait, 10)
    deadline = loop.time() + 10  # a lease (3 s) and a reap, well short of the 30 s
    while len(await calls()) < 2:
        assert loop.time() < deadline, "nobody probed again"
        await asyncio.sleep(0.1)


async def test_a_probe_longer_than_its_keys_first_life_stays_the_only_one(
    gateway: Gateway, upstream: str, dispatcher_process: Spawn,
) -> None:
    """The probe's key was set for a lease (or the permit's time) once, at its claim: a probe
    call outliving that (its lease renewed meanwhile) let the next claim send a second probe
    to an upstream still asking for a pause. Its renewals keep its key now."""
    url = f"{upstream}/longprobe"
    await gateway.add_endpoint("longprobe", url, permit_ttl_s=1, max_concurrency=4)
    auth = await gateway.new_key()
    signal = await gateway.submit(auth, url, headers={"X-Mock-Reply-Headers": [json.dumps(
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"})]})
    dispatcher_process()
    await gateway.wait_finished(auth, [signal["task_id"]])
    slow = (await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["8000"]}))["task_id"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not [e for e in await _log(upstream) if e["idempotency_key"] == slow]:
        assert loop.time() < deadline, "no probe after the pause"
        await asyncio.sleep(0.05)
    after = (await gateway.submit(auth, url))["task_id"]  # held behind the probe
    await asyncio.sleep(5)  # past the 3 s lease its key was first set for
    assert not [e for e in await _log(upstream) if e["idempotency_key"] == after]
    await gateway.wait_finished(auth, [slow, after], timeout=20)
