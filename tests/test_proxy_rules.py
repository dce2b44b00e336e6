"""The drop-in proxy under the rules of its endpoint's line (docs/guides/proxy.md, "What a
proxied request is"): a request the upstream paused keeps its place in line, per_user fairness
interleaves callers, the caller's daily quota refuses it as it refuses a submit, metrics and
the admin listings count it, its default max wait is 60 s (past it, its task `expired`), and an
Anthropic stream settles its cost to input + output tokens."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from redis.asyncio import ConnectionPool, Redis, RedisCluster

from tests.conftest import Gateway
from tests.servers import mock_log, mock_upstream
from tests.test_proxy import (
    CHAT,
    StartApi,
    StartDispatcher,
    mock_stats,
    proxied,
    settled,
    tasks_of,
    until,
)


async def created_and_expiry(gateway: Gateway, task_id: str) -> tuple[int, int]:
    """A pending task's creation and the time it expires unless admitted (ms, Redis clock),
    as submit-11.lua keeps them in its hash."""
    created, pexp = await gateway.rt.redis.hmget(gateway.rt.keys.task(task_id),
                                                 ["created_at", "pexp"])
    return int(str(created)), int(str(pexp))


def who(entry: dict[str, object]) -> str:
    """The name a test's request carried in its body (`{"who": ...}`)."""
    return str(json.loads(str(entry["body"]))["who"])


@pytest.mark.backends("single", "cluster")
async def test_a_request_the_upstream_paused_keeps_its_place_in_line(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """Cap 1. A is called first and refused: 429 with Retry-After: 3 (only for its first call,
    X-Mock-Status-Times). While the endpoint is paused, B and then C arrive at the same
    priority. When the pause ends A goes again before them: the upstream sees A (429), A, B, C,
    and every caller gets a 200 (A never sees the 429)."""
    auth = await proxied(gateway, upstream, max_concurrency=1)
    base = await start_api()
    await start_dispatcher()
    refuse = {"X-Mock-Status": "429", "X-Mock-Status-Times": "1",
              "X-Mock-Reply-Headers": json.dumps({"retry-after": "3"})}
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        def ask(name: str, headers: dict[str, str] | None = None) -> asyncio.Future[Any]:
            return asyncio.ensure_future(http.post(
                "/proxy/llm/chat", json={"who": name}, headers=headers))

        a = ask("A", refuse)

        async def refused() -> str | None:
            log = mock_log(upstream)
            return str(log[0]["idempotency_key"]) if log and log[0]["status"] == 429 else None

        a_id = await until(refused)

        async def in_line(n: int) -> bool:  # others than A (which may be set aside) pending
            return len([t for t in await tasks_of(gateway, "pending")
                        if t["task_id"] != a_id]) == n

        b = ask("B")
        await until(lambda: in_line(1))
        c = ask("C")
        await until(lambda: in_line(2))
        # B and C came while the pause held: nothing was called since A's refusal.
        assert len(mock_log(upstream)) == 1, "the pause ended before B and C were in line"
        answers = await asyncio.gather(a, b, c)
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert answers[0].headers["x-queue-task-id"] == a_id
    calls = mock_log(upstream)
    assert [(who(e), e["status"]) for e in calls] == [
        ("A", 429), ("A", 200), ("B", 200), ("C", 200)]
    assert calls[1]["idempotency_key"] == a_id  # the same task went again
    # The endpoint paused for what the upstream asked (to the whole second of the clock in the
    # third second, app/queue/signals.py); only then did A go again.
    refused_at, again_at = (float(str(e["t"])) for e in calls[:2])
    assert again_at >= (refused_at // 1000 + 3) * 1000


@pytest.mark.backends("single", "cluster")
async def test_the_daily_quota_refuses_a_proxied_request_as_it_refuses_a_submit(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """A key with a daily quota of 2: a submitted task and a proxied request use it up (one
    count for both ways in). The next proxied request and the next submit are both refused
    `429 quota_exceeded` with a Retry-After, and the refused request is never called."""
    await gateway.add_endpoint("llm", f"{upstream}/v1", proxy=True, forward_headers=[])
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 31, "daily_quota": 2})
    assert r.status_code == 201, r.text
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    base = await start_api()
    await start_dispatcher()
    queued = await gateway.submit(auth, f"{upstream}/v1")
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        ok = await http.post("/proxy/llm/chat/completions", json=CHAT)
        assert ok.status_code == 200, ok.text
        over = await http.post("/proxy/llm/chat/completions", json=CHAT)
        submit_over = await http.post("/api/v1/tasks", json={"target_url": f"{upstream}/v1"})
    for refused in (over, submit_over):
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "quota_exceeded"
        assert 0 < int(refused.headers["retry-after"]) <= 86400
    assert "x-queue-task-id" not in over.headers
    (done,) = await gateway.wait_finished(auth, [queued["task_id"]])
    assert done["task_status"] == "completed"
    await asyncio.sleep(0.3)  # a call made for the refused request would have arrived by now
    # The queued task and the first proxied request (no cap: in either order); nothing else.
    assert sorted(str(e["path"]) for e in mock_log(upstream)) == ["/v1", "/v1/chat/completions"]
    assert await tasks_of(gateway, "pending") == []


def samples(text: str, endpoint: str) -> dict[str, float]:
    """The Prometheus text's samples labelled with `endpoint`: `name{other labels}` -> value."""
    out: dict[str, float] = {}
    label = f'endpoint="{endpoint}"'
    for line in text.splitlines():
        if line.startswith("#") or label not in line:
            continue
        name, _, value = line.rpartition(" ")
        labels = name[name.index("{") + 1:name.rindex("}")].split(",")
        rest = ",".join(x for x in labels if x != label)
        out[name[:name.index("{")] + (f"{{{rest}}}" if rest else "")] = float(value)
    return out


@pytest.mark.backends("single", "cluster")
async def test_metrics_and_the_admin_listings_count_proxied_requests(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """One submitted task and three proxied requests (two answered 200, one 500) on one
    endpoint: /metrics counts all four under the endpoint (submitted, admitted, completed,
    failed, the upstream's 5xx and the latency histograms), and /admin/v1/tasks lists each
    proxied one with type `proxy` and its final status."""
    auth = await proxied(gateway, upstream)
    base = await start_api()
    await start_dispatcher()
    queued = (await gateway.submit(auth, f"{upstream}/v1"))["task_id"]

    async def ended() -> bool:  # read as an operator: its owner's read would let it go
        r = await gateway.http.get(f"/admin/v1/tasks/{queued}", headers=gateway.admin)
        return bool(r.json()["task_status"] == "completed")

    await until(ended)
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        answers = [await http.post("/proxy/llm/chat", json=CHAT) for _ in range(2)]
        answers.append(await http.post("/proxy/llm/chat", json=CHAT,
                                       headers={"X-Mock-Status": "500"}))
    assert [r.status_code for r in answers] == [200, 200, 500]
    ids = [r.headers["x-queue-task-id"] for r in answers]
    r = await gateway.http.get("/metrics")
    assert r.status_code == 200
    got = samples(r.text, "llm")
    expected = {"qgw_tasks_submitted_total": 4, "qgw_tasks_admitted_total": 4,
                "qgw_tasks_completed_total": 3, "qgw_tasks_failed_total": 1,
                "qgw_upstream_failures_total{class=\"5xx\"}": 1,
                "qgw_queue_wait_seconds_count": 4, "qgw_upstream_latency_seconds_count": 3,
                "qgw_upstream_failed_latency_seconds_count": 1,
                "qgw_queue_pending": 0, "qgw_queue_in_flight": 0}
    assert {name: got.get(name) for name in expected} == expected, got
    r = await gateway.http.get("/admin/v1/tasks", params={"endpoint": "llm"},
                               headers=gateway.admin)
    assert r.status_code == 200, r.text
    listed = {t["task_id"]: (t["task_type"], t["task_status"]) for t in r.json()["tasks"]}
    assert listed == {ids[0]: ("proxy", "completed"), ids[1]: ("proxy", "completed"),
                      ids[2]: ("proxy", "failed"), queued: ("offline", "completed")}, listed
    r = await gateway.http.get(f"/admin/v1/tasks/{ids[2]}", headers=gateway.admin)
    assert r.status_code == 200, r.text
    shown = r.json()
    assert (shown["task_type"], shown["task_status"], shown["endpoint"]) == (
        "proxy", "failed", "llm")
    assert shown["result_status_code"] == 500


@pytest.mark.backends("single", "cluster")
async def test_the_default_max_wait_is_60_s(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """Without X-Queue-Max-Wait, shown without waiting a minute. Two endpoints of cap 1, their
    upstream held with one call in flight each; with no measurement yet the line promises half
    an `avg_exec_ms` to the next request: 59 s on one, 61 s on the other. Without the header
    the 61 s one is refused at once (`503 wait_exceeded`, nothing called) while a request
    allowing 61 s is let in line; the 59 s one is let in line, and its task's deadline, the
    one the expiry sweep ends it at, is 60 s after its creation."""
    for name, avg in (("w59", 118_000), ("w61", 122_000)):
        await gateway.add_endpoint(name, f"{upstream}/{name}", proxy=True, forward_headers=[],
                                   max_concurrency=1, avg_exec_ms=avg)
    auth = await gateway.new_key()
    base = await start_api()
    await start_dispatcher()  # admits the waiting ones once the held calls end
    httpx.post(f"{upstream}/_mock/config", json={"hold": True}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        def ask(name: str, headers: dict[str, str] | None = None) -> asyncio.Future[Any]:
            return asyncio.ensure_future(http.post(f"/proxy/{name}/x", json={},
                                                   headers=headers))

        held = [ask("w59"), ask("w61")]
        await until(lambda: settled(mock_stats(upstream)["in_flight"] == 2))
        started = time.monotonic()
        refused = await http.post("/proxy/w61/x", json={})
        assert time.monotonic() - started < 5  # at once, not after a wait
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "wait_exceeded" and error["wait_time"] == 61, error
        assert int(refused.headers["retry-after"]) >= 1
        assert await tasks_of(gateway, "pending", "w61") == []  # out of line: `expired`
        expired = await tasks_of(gateway, "expired", "w61")
        assert [t["task_id"] for t in expired] == [error["task_id"]], expired
        allowed = ask("w61", {"X-Queue-Max-Wait": "61"})
        (waiting61,) = await until(lambda: tasks_of(gateway, "pending", "w61"))
        waiting = ask("w59")
        (waiting59,) = await until(lambda: tasks_of(gateway, "pending", "w59"))
        created, pexp = await created_and_expiry(gateway, waiting59["task_id"])
        assert pexp - created == 60_000
        due = await gateway.rt.redis.zscore(gateway.rt.keys.deadlines("w59"),
                                            waiting59["task_id"])
        assert due is not None and int(due) - created == 60_000
        created, pexp = await created_and_expiry(gateway, waiting61["task_id"])
        assert pexp - created == 61_000  # the header's, where one is given
        assert not allowed.done() and not waiting.done()
        assert len(mock_log(upstream)) == 2  # the refused request was never called
        httpx.post(f"{upstream}/_mock/release").raise_for_status()
        answers = await asyncio.gather(*held, allowed, waiting)
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]


ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
    b'"type":"message","role":"assistant","content":[],"model":"claude-x",'
    b'"usage":{"input_tokens":12,"output_tokens":1}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: ping\ndata: {"type": "ping"}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
    b'"stop_sequence":null},"usage":{"output_tokens":40}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.backends("single", "cluster")
async def test_an_anthropic_stream_settles_its_cost_to_input_plus_output_tokens(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """cost_from `sse:message.usage.input_tokens+usage.output_tokens` (docs/guides/proxy.md,
    "Cost from a stream") under 1,000 units an hour: an Anthropic stream telling 12 input
    tokens in message_start and 40 output tokens in message_delta settles to 52. The limit's
    window holds 52 units for it, the caller's real cost is 52, and so a request of 949 units
    waits (refused at its max wait) while one of 948 goes through at once."""
    limit = {"limiter": "sliding_window", "rate": 1000, "interval_ms": 3_600_000,
             "per": "cost"}
    auth = await proxied(gateway, upstream, limits=[limit],
                         cost_from="sse:message.usage.input_tokens+usage.output_tokens")
    base = await start_api()
    await start_dispatcher()
    stream = {"X-Mock-Body-Base64": base64.b64encode(ANTHROPIC_STREAM).decode(),
              "X-Mock-Reply-Headers": json.dumps({"content-type": "text/event-stream"}),
              "X-Queue-Cost": "100"}
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/llm/messages", headers=stream, json={
            "model": "claude-x", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.content == ANTHROPIC_STREAM
        task_id = r.headers["x-queue-task-id"]
        done = await gateway.status(auth, task_id)
        assert done["task_status"] == "completed", done
        redis, keys = gateway.rt.redis, gateway.rt.keys
        window = await redis.zrange(keys.further_limit(
            "llm", "sliding_window", "cost", 1000, 3_600_000), 0, -1)
        assert [int(str(m).rsplit(":", 1)[1]) for m in window] == [52], window
        real = await redis.hget(keys.real_costs("llm"), "1")
        assert real is not None and float(str(real).split(",")[0]) == 52, real
        over = await http.post("/proxy/llm/messages", json={}, headers={
            "X-Queue-Cost": "949", "X-Queue-Max-Wait": "1"})
        assert over.status_code == 503, over.text
        assert over.json()["error"]["code"] == "wait_exceeded"
        fits = await http.post("/proxy/llm/messages", json={}, headers={"X-Queue-Cost": "948"})
        assert fits.status_code == 200, fits.text
        assert int(fits.headers["x-queue-waited-ms"]) < 3000
    assert [e["path"] for e in mock_log(upstream)] == ["/v1/messages"] * 2


@pytest.mark.backends("single", "cluster")
async def test_per_user_fairness_interleaves_proxied_callers(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """A per_user endpoint of cap 1, its upstream held: user 1's first request is in flight,
    three more of theirs wait, then user 2 sends two. Released, user 2's are served among user
    1's, not after all of them (first in, first out would serve 1, 1, 1, 1, 2, 2)."""
    await gateway.add_endpoint("fair", f"{upstream}/v1", proxy=True, forward_headers=[],
                               max_concurrency=1, fairness="per_user")
    one, two = await gateway.new_key(user_id=1), await gateway.new_key(user_id=2)
    base = await start_api()
    await start_dispatcher()
    httpx.post(f"{upstream}/_mock/config", json={"hold": True}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        def ask(auth: dict[str, str], name: str) -> asyncio.Future[Any]:
            return asyncio.ensure_future(http.post("/proxy/fair/x", json={"who": name},
                                                   headers=auth))

        async def waiting(n: int) -> bool:
            return len(await tasks_of(gateway, "pending", "fair")) == n

        sent = [ask(one, "1a")]
        await until(lambda: settled(mock_stats(upstream)["in_flight"] == 1))
        for i, (auth, name) in enumerate([(one, "1b"), (one, "1c"), (one, "1d"),
                                          (two, "2a"), (two, "2b")]):
            sent.append(ask(auth, name))
            await until(lambda n=i + 1: waiting(n))  # type: ignore[misc]
        httpx.post(f"{upstream}/_mock/release").raise_for_status()
        answers = await asyncio.gather(*sent)
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    order = [who(e) for e in mock_log(upstream)]
    assert order[0] == "1a" and sorted(order) == ["1a", "1b", "1c", "1d", "2a", "2b"], order
    assert order.index("2b") < order.index("1d"), order  # user 2 did not wait for all of 1's
    assert [n for n in order if n[0] == "1"] == ["1a", "1b", "1c", "1d"], order  # each in turn


async def _commands_naming(gateway: Gateway, key: str, needle: str, seconds: float) -> list[str]:
    """What clients send Redis (the node holding `key`, on a Cluster) naming `needle` over
    `seconds`, seen through MONITOR; not what scripts run (the expiry sweep reads the head of
    the line: its own walk, not a process polling)."""
    rc = gateway.rt.redis
    if isinstance(rc, RedisCluster):
        node = rc.get_node_from_key(key)
        client = Redis(host=node.host, port=node.port, decode_responses=True)
    else:  # a connection of its own: one in MONITOR serves nothing else
        pool = rc.connection_pool
        client = Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class,
                                                      **pool.connection_kwargs))
    seen: list[str] = []
    watching = asyncio.Event()

    async def listen() -> None:
        async with client.monitor() as m:
            watching.set()
            async for c in m.listen():
                if c.get("client_type") != "lua" and needle in str(c.get("command", "")):
                    seen.append(str(c["command"]))

    task = asyncio.ensure_future(listen())
    try:
        await asyncio.wait_for(watching.wait(), 10)
        await asyncio.sleep(seconds)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose(close_connection_pool=True)
    return seen


@pytest.mark.backends("single", "cluster")
async def test_a_waiting_request_is_told_its_turn_not_polling(
    gateway: Gateway, upstream: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """Cap 1, the upstream held: a second request waits. Over 2 s of its wait Redis runs
    nothing that names its task (a process polling for its turn, as LiteLLM's queue does every
    30 ms, would read it over and over); released, it is admitted by the dispatcher's claim,
    which its API process hears as the task's status event, and answered."""
    auth = await proxied(gateway, upstream, max_concurrency=1)
    base = await start_api()
    await start_dispatcher()
    httpx.post(f"{upstream}/_mock/config", json={"hold": True}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        first = asyncio.ensure_future(http.post("/proxy/llm/chat", json=CHAT))
        await until(lambda: settled(mock_stats(upstream)["in_flight"] == 1))
        second = asyncio.ensure_future(http.post("/proxy/llm/chat", json=CHAT))
        (waiting,) = await until(lambda: tasks_of(gateway, "pending"))
        task_id = waiting["task_id"]
        await asyncio.sleep(0.2)  # past its submit and the one read once it watches
        named = await _commands_naming(gateway, gateway.rt.keys.task(task_id), task_id, 2.0)
        assert named == [], named
        assert not second.done()
        httpx.post(f"{upstream}/_mock/release").raise_for_status()
        answers = await asyncio.gather(first, second)
    assert [r.status_code for r in answers] == [200, 200]
    assert answers[1].headers["x-queue-task-id"] == task_id


@pytest.mark.backends("single", "cluster")
async def test_an_adaptive_cap_learns_from_proxied_calls(
    gateway: Gateway, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """An adaptive endpoint (at most 30 at once) in front of an upstream that takes 4 calls at
    once and refuses more with a plain 429 (no pause: relayed to its caller), 80 proxied
    requests at once: the proxy's acks teach the cap what the upstream takes, as a dispatcher's
    do, and most calls are answered; a fixed cap of 30 would have had most refused (the
    control in test_adaptive.py)."""
    with mock_upstream("--concurrency", "4", "--latency-ms", "100") as base:
        await gateway.add_endpoint("llm", f"{base}/v1", proxy=True, forward_headers=[],
                                   concurrency="adaptive", max_concurrency=30)
        auth = await gateway.new_key()
        api = await start_api()
        await start_dispatcher()
        async with httpx.AsyncClient(base_url=api, headers=auth, timeout=60,
                                     limits=httpx.Limits(max_connections=None)) as http:
            # A long max wait: a new endpoint's estimate (no call measured yet, a cap that
            # starts low) would refuse some at once.
            answers = await asyncio.gather(*(
                http.post("/proxy/llm/learn", json={}, headers={"X-Queue-Max-Wait": "600"})
                for _ in range(80)))
        statuses = Counter(r.status_code for r in answers)
        r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
        (row,) = [q for q in r.json()["endpoints"] if q["id"] == "llm"]
    assert set(statuses) <= {200, 429} and statuses[429] < 0.3 * 80, statuses
    assert row["adaptive_limit"] is not None and 1 <= row["adaptive_limit"] <= 8, row
