"""The acks of one event-loop turn: one script call per endpoint (lua/ack-7.lua), each task
finished as if on its own, the endpoint's stats exact."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest

from app.endpoints import EndpointConfig
from app.queue.claims import CLAIM_FIELDS, Claim
from app.queue.dispatcher import Dispatcher
from app.queue.upstream import Outcome, Request
from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")  # one slot per call on a Cluster


async def test_acks_sent_together_finish_each_task_and_count_each_once(
    gateway: Gateway, upstream: str
) -> None:
    """Seven tasks acked in one turn: four failed calls, two completed, and one whose lease a
    newer attempt holds (it stays that attempt's). Statuses, results, the outbox, the active
    set and every counter, bucket and failure record come out as seven acks one by one would
    leave them."""
    rt, url = gateway.rt, f"{upstream}/acks"
    endpoint, disp = await _queued(gateway, "acks", url, 7)
    keys, args = disp.claim_call(endpoint, 7)
    res = await rt.queue.scripts.claim(keys=keys, args=args)
    claims = [Claim(endpoint, tid, token, int(attempts), ttype, Request("POST", url, "{}", "", ""))
              for tid, token, attempts, ttype, *_ in
              (res[i:i + CLAIM_FIELDS] for i in range(3, len(res), CLAIM_FIELDS))]
    assert len(claims) == 7
    lost = claims[2]
    await rt.redis.hset(rt.keys.task(lost.task_id), "lease", "a-newer-attempt")
    outcomes = [Outcome(400, f"bad {i}") for i in range(4)] + [
        Outcome(200, "fine"), Outcome(200, "stale"), Outcome(201, "made")]
    claims = [*claims[:2], *claims[3:5], claims[5], lost, claims[6]]

    acked = await asyncio.gather(*(disp.acks.ack(c, o, 12.0)
                                   for c, o in zip(claims, outcomes, strict=True)))

    assert acked == [1, 1, 1, 1, 1, 0, 1]
    task = await rt.redis.hgetall(rt.keys.task(lost.task_id))
    assert (task["status"], task["lease"]) == ("processing", "a-newer-attempt")
    for c, o in zip(claims, outcomes, strict=True):
        if c is lost:
            continue
        task = await rt.redis.hgetall(rt.keys.task(c.task_id))
        assert task["status"] == ("completed" if o.ok else "failed")
        assert (task["result"], task["result_status_code"]) == (o.text, str(o.status_code))
        assert "lease" not in task
    e = endpoint.id
    assert await rt.redis.zrange(rt.keys.active(e), 0, -1) == [lost.task_id]
    outbox = set(await rt.redis.zrange(rt.keys.outbox(e), 0, -1))
    assert outbox == {c.task_id for c in claims} - {lost.task_id}

    stats = cast("dict[str, str]", await rt.redis.hgetall(rt.keys.stats(e)))  # decode_responses
    assert (stats["completed"], stats["failed"], stats["fail_4xx"]) == ("2", "4", "4")
    assert _bucketed(stats, "upstream_ms") == (2, 24)
    assert _bucketed(stats, "upstream_failed_ms") == (4, 48)
    # The n-th failure is kept in slot n % 5, as when each ack wrote its own.
    failed = [c.task_id for c in claims[:4]]
    assert [_failure(stats, n)["task_id"] for n in range(1, 5)] == failed
    assert _failure(stats, 4) == {**_failure(stats, 4), "code": 400, "reason": "bad 3"}
    done = sum(int(v) for f, v in stats.items() if f.startswith("done:") and ":t" not in f)
    assert done == 6
    assert float(stats["exec_ms"]) == 12.0
    assert float(stats["slot_ms"]) >= 0


async def test_an_ack_of_the_last_queued_task_says_the_line_is_empty(
    gateway: Gateway, upstream: str
) -> None:
    """The first value says whether work still waits (the claim behind the next acks is
    skipped when not), and a marker wakes a dispatcher for what waits."""
    rt, url = gateway.rt, f"{upstream}/line"
    endpoint, disp = await _queued(gateway, "line", url, 2)
    wake = rt.keys.wake(endpoint.id)
    for remaining in (True, False):
        keys, args = disp.claim_call(endpoint, 1)
        res: list[Any] = await rt.queue.scripts.claim(keys=keys, args=args)
        await rt.redis.zrem(wake, endpoint.id)
        claim = Claim(endpoint, res[3], res[4], 1, "offline", Request("POST", url, "{}", "", ""))
        assert await disp.acks.ack(claim, Outcome(200, "ok"), 1.0) == 1
        assert disp.acks.backlog.get(endpoint.id, True) is remaining
        assert (await rt.redis.zscore(wake, endpoint.id) is not None) is remaining


async def _queued(gateway: Gateway, name: str, url: str, tasks: int
                  ) -> tuple[EndpointConfig, Dispatcher]:
    """An endpoint with `tasks` queued, and a dispatcher to claim and ack them by hand (it
    makes no call, and is never started)."""
    rt = gateway.rt
    await gateway.add_endpoint(name, url)
    auth = await gateway.new_key()
    for _ in range(tasks):
        await gateway.submit(auth, url)
    endpoint = rt.registry.get(name)
    assert endpoint is not None
    return endpoint, Dispatcher(rt.redis, rt.redis, rt.keys, rt.queue.scripts, rt.registry,
                                rt.settings, None)  # type: ignore[arg-type]


def _bucketed(stats: dict[str, str], name: str) -> tuple[int, int]:
    """Observations in a histogram's buckets, and its sum."""
    count = sum(int(v) for f, v in stats.items()
                if f.startswith(f"{name}:") and not f.endswith(":sum"))
    return count, int(stats[f"{name}:sum"])


def _failure(stats: dict[str, str], n: int) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(stats[f"fail:{n % 5}"])
    return record
