"""The drop-in proxy when a caller or its API process goes away, and how it streams: headers at
once, events as they come, the cost read from the stream."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import psutil
import pytest

from app.mock_upstream import binary_digest
from app.proxy.cost import EVENT_BYTES, CostReader
from tests.conftest import Gateway
from tests.servers import QGW, free_port, mock_log, stop, wait_port
from tests.test_proxy import (
    CHAT,
    StartApi,
    StartDispatcher,
    llm,
    mock_stats,
    openai_server,
    proxied,
    settled,
    tasks_of,
    until,
)
from tests.test_result_store import peak_rss

__all__ = ["llm", "openai_server"]


async def raw_post(base: str, auth: dict[str, str], path: str, header: str
                   ) -> asyncio.StreamWriter:
    """POST `{}` to `path` on a socket of its own, which reads nothing of the answer: the
    caller closes it (or leaves it open, unread) as a test needs."""
    host, port = base.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
                 f"{auth['Authorization']}\r\n{header}\r\nContent-Length: 2\r\n\r\n{{}}"
                 .encode())
    await writer.drain()
    return writer


@pytest.mark.backends("single", "cluster")
async def test_caller_gone_while_waiting_cancels_its_task(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    # Paused, no dispatcher: the request waits in line (first in line, its API process would
    # admit it itself).
    auth = await proxied(gateway, llm, paused=True)
    base = await start_api()
    writer = await raw_post(base, auth, "/proxy/llm/chat/completions",
                            "Content-Type: application/json")
    (pending,) = await until(lambda: tasks_of(gateway, "pending"), timeout=30)
    writer.close()
    await until(lambda: tasks_of(gateway, "cancelled"), timeout=3)
    r = await gateway.http.patch("/admin/v1/endpoints/llm", headers=gateway.admin,
                                 json={"paused": False})
    assert r.status_code == 200, r.text
    await start_dispatcher()
    await asyncio.sleep(1)
    assert mock_log(llm) == []  # never called
    assert await tasks_of(gateway, "pending") == []
    assert (await tasks_of(gateway, "cancelled"))[0]["task_id"] == pending["task_id"]


@pytest.mark.backends("single", "cluster")
async def test_headers_at_once_then_events_as_they_come(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()
    # The upstream's headers at once, then each event 300 ms after the one before (the
    # first too, as an LLM API's first token comes a while after its headers).
    httpx.post(f"{llm}/_mock/config", json={"chunks": 6, "chunk_ms": 300}).raise_for_status()
    arrivals = []
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        started = time.monotonic()
        async with http.stream("POST", "/proxy/llm/chat/completions",
                               json={**CHAT, "stream": True}) as r:
            headed = time.monotonic() - started
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "transfer-encoding" not in r.headers or r.headers["transfer-encoding"] == \
                "chunked"  # ours, not the upstream's relayed
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.monotonic() - started)
    # The headers went on as they came, not with the first event: well ahead of it. (How long
    # the headers took is the host's: a Cluster test on a busy host once took 2.3 s.)
    assert arrivals[0] - headed > 0.2, (headed, arrivals[0])
    assert arrivals[-1] - arrivals[1] > 1.0  # spread as the upstream spaced them, not bunched
    assert len(arrivals) == 1 + 6 + 1 + 1  # role, six tokens, stop, [DONE]


@pytest.mark.backends("single", "cluster")
async def test_api_killed_mid_stream_fails_the_task_once_its_lease_lapses(
    gateway: Gateway, llm: str, env: dict[str, str], start_dispatcher: StartDispatcher
) -> None:
    auth = await proxied(gateway, llm, max_concurrency=1)
    await start_dispatcher()  # its reaper ends the task
    proc, port = await api_process(env)
    try:
        httpx.post(f"{llm}/_mock/config", json={"chunks": 200, "chunk_ms": 100}).raise_for_status()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=auth,
                                     timeout=30) as http:
            async with http.stream("POST", "/proxy/llm/chat/completions",
                                   json={**CHAT, "stream": True}) as r:
                task_id = r.headers["x-queue-task-id"]
                async for _ in r.aiter_lines():
                    break
                os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()

        async def ended() -> dict[str, Any] | None:
            view = await gateway.status(auth, task_id)
            return view if view["task_status"] != "processing" else None

        view = await until(ended, timeout=15)
        assert view["task_status"] == "failed" and view["task_result"] == "caller connection lost"
        assert time.monotonic() - killed < 3.0 + 2.0  # the lease (3 s here) and a reap
        await until(lambda: settled(mock_stats(llm)["in_flight"] == 0))
        await asyncio.sleep(1.5)
        assert len(mock_log(llm)) == 1  # never run again
        # Its slot (the cap is 1) is free: the next request through the gateway is served.
        task = await gateway.submit(auth, f"{llm}/v1")
        (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=10)
        assert done["task_status"] == "completed"
    finally:
        stop(proc, timeout=1)


@pytest.mark.backends("single", "cluster")
async def test_an_api_process_stopped_withdraws_the_requests_waiting_in_it(
    gateway: Gateway, llm: str, env: dict[str, str], start_api: StartApi,
    start_dispatcher: StartDispatcher,
) -> None:
    """Cap 1, the upstream held by a request through another API process; one waits in line
    through an API process that is told to stop (SIGTERM, as a rolling deploy does). When its
    grace ends, the request still waiting is cut short (`503 shutting_down`: never called, to
    send again), and its task is withdrawn (cancelled), not left pending for a dispatcher to
    admit for nobody (a slot held for a whole lease)."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    base = await start_api()
    await start_dispatcher()
    proc, port = await api_process(env)
    try:
        async with httpx.AsyncClient(headers=auth, timeout=30) as http:
            holding = asyncio.ensure_future(http.post(f"{base}/proxy/llm/chat/completions",
                                                      json=CHAT))
            await until(lambda: settled(mock_stats(llm)["in_flight"] == 1))
            cut = asyncio.ensure_future(http.post(
                f"http://127.0.0.1:{port}/proxy/llm/chat/completions", json=CHAT))
            (waiting,) = await until(lambda: tasks_of(gateway, "pending"))
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
            answer = await cut  # cut short: a clear error, to send it again elsewhere
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "shutting_down"
            assert answer.headers["retry-after"] == "1"
            view = await gateway.http.get(f"/admin/v1/tasks/{waiting['task_id']}",
                                          headers=gateway.admin)
            assert view.json()["task_status"] == "cancelled", view.text
            httpx.post(f"{llm}/_mock/release").raise_for_status()
            assert (await holding).status_code == 200
        await asyncio.sleep(0.5)  # a call made for the withdrawn request would be in by now
        assert len(mock_log(llm)) == 1
    finally:
        stop(proc, timeout=1)


@pytest.mark.backends("single", "cluster")
async def test_requests_waiting_in_a_killed_api_process_do_not_hold_the_line(
    gateway: Gateway, llm: str, env: dict[str, str],
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Cap 1, the upstream held by a request through a live API process; four wait in line
    through another, killed with -9 (nothing withdraws them). A dispatcher with a whole lease
    of 15 s would give each orphan it admits the slot that long, one after the other: the
    next live caller would wait a minute. Instead the one admitted while its process's marker
    was still fresh holds it only for the pickup lease (3 s), the others end `failed` at the
    claim once the marker is seen gone for the settle (2 s), never admitted, and the live
    caller is served within seconds. Its own process has a whole lease of 15 s and a marker
    TTL of 3 s: its admission's pickup lease (3 s) is renewed in time, as its stream outlasts
    it. No orphan is ever called."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    dispatcher_process(QGW_LEASE_MS="15000", QGW_REAP_INTERVAL_MS="200")
    live, live_port = await api_process({**env, "QGW_LEASE_MS": "15000",
                                         "QGW_PROXY_OWNER_TTL_MS": "3000"})
    proc, port = await api_process(env)  # its lease, and so its markers' TTL: 3 s
    base = f"http://127.0.0.1:{live_port}"
    try:
        async with httpx.AsyncClient(headers=auth, timeout=60) as http:
            url = "/proxy/llm/chat/completions"
            holding = asyncio.ensure_future(http.post(f"{base}{url}", json=CHAT))
            await until(lambda: settled(mock_stats(llm)["in_flight"] == 1))
            doomed = [asyncio.ensure_future(http.post(f"http://127.0.0.1:{port}{url}",
                                                      json=CHAT)) for _ in range(4)]
            orphans = await until(lambda: _at_least(4, tasks_of(gateway, "pending")))
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            httpx.post(f"{llm}/_mock/config", json={"hold": False}).raise_for_status()
            httpx.post(f"{llm}/_mock/release").raise_for_status()
            assert (await holding).status_code == 200
            # The live caller's stream lasts past the pickup lease: its process renewed it.
            httpx.post(f"{llm}/_mock/config", json={"chunks": 45, "chunk_ms": 100}
                       ).raise_for_status()
            async with http.stream("POST", f"{base}{url}", json={**CHAT, "stream": True}) as r:
                served_s = time.monotonic() - killed
                assert r.status_code == 200
                body = b"".join([chunk async for chunk in r.aiter_bytes()])
            assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 45 + 3
            # The pickup lease (3 s), the settle (2 s) and reaps, not a whole lease (15 s) an
            # orphan
            assert served_s < 10.0, served_s
            view = await gateway.status(auth, r.headers["x-queue-task-id"])
            assert view["task_status"] == "completed"
        for caller in doomed:
            with pytest.raises(httpx.HTTPError):
                await caller
        for orphan in orphans:
            got = await gateway.http.get(f"/admin/v1/tasks/{orphan['task_id']}",
                                         headers=gateway.admin)
            assert got.json()["task_status"] == "failed", got.text
            assert got.json()["task_result"] == "caller connection lost"
        assert len(mock_log(llm)) == 2  # the one held and the live one
    finally:
        stop(proc, timeout=1)
        stop(live)


@pytest.mark.backends("single", "cluster")
async def test_a_stalled_api_process_keeps_its_waiting_request(
    gateway: Gateway, llm: str, env: dict[str, str], start_api: StartApi,
    start_dispatcher: StartDispatcher,
) -> None:
    """A request waits 1.5 s through an API process whose marker has a TTL of 1 s (renewed
    meanwhile), then the process stalls (SIGSTOP) for longer than that TTL, as one does
    whose Redis was away longer. The slot frees while it is stalled: the claim finds the
    marker gone but holds the line for the settle (2 s) instead of ending the request; the
    process, woken once the claim has seen that, writes its marker again, and the request is
    served."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    base = await start_api()
    await start_dispatcher()
    proc, port = await api_process({**env, "QGW_PROXY_OWNER_TTL_MS": "1000"})
    try:
        async with httpx.AsyncClient(headers=auth, timeout=30) as http:
            url = "/proxy/llm/chat/completions"
            holding = asyncio.ensure_future(http.post(f"{base}{url}", json=CHAT))
            await until(lambda: settled(mock_stats(llm)["in_flight"] == 1))
            waiting = asyncio.ensure_future(http.post(f"http://127.0.0.1:{port}{url}",
                                                      json=CHAT))
            (task,) = await until(lambda: tasks_of(gateway, "pending"))
            marker = await gateway.rt.redis.hget(gateway.rt.keys.task(task["task_id"]), "owner")
            assert marker is not None
            await asyncio.sleep(1.5)
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.5)
            httpx.post(f"{llm}/_mock/config", json={"hold": False}).raise_for_status()
            httpx.post(f"{llm}/_mock/release").raise_for_status()
            assert (await holding).status_code == 200

            async def seen_gone() -> bool:  # by the claim, which then holds the line
                return str(await gateway.rt.redis.get(marker)).startswith("gone:")
            await until(seen_gone, timeout=5)
            proc.send_signal(signal.SIGCONT)
            r = await waiting
            assert r.status_code == 200, r.text
        assert len(mock_log(llm)) == 2
    finally:
        proc.send_signal(signal.SIGCONT)
        stop(proc, timeout=1)


async def _at_least(n: int, items: Awaitable[list[Any]]) -> list[Any] | None:
    found = await items
    return found if len(found) >= n else None


async def api_process(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """A `qgw api` of the test's own (to kill, stop or watch), once it listens: the process and
    its port. The caller stops it."""
    port = free_port()
    proc = subprocess.Popen([*QGW, "api", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_port, port, 30.0, proc)
    except BaseException:
        stop(proc, timeout=1)
        raise
    return proc, port


def test_cost_read_from_openai_and_anthropic_streams() -> None:
    openai = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,'
              b'"total_tokens":8}}\n\ndata: [DONE]\n\n')
    reader = CostReader("sse:usage.total_tokens")
    for i in range(0, len(openai), 7):  # events cut anywhere between reads
        reader.feed(openai[i:i + 7])
    assert reader.cost({}) == 8
    anthropic = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                 b'{"input_tokens":12,"output_tokens":1}}}\n\n'
                 b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
                 b'event: message_delta\ndata: {"type":"message_delta","usage":'
                 b'{"output_tokens":40}}\n\n')
    reader = CostReader("sse:message.usage.input_tokens+usage.output_tokens")
    reader.feed(anthropic)
    assert reader.cost({}) == 52
    missing = CostReader("sse:usage.total_tokens")
    missing.feed(b'data: {"choices":[]}\n\n')
    assert missing.cost({}) is None  # the reservation stands
    # The format's other line ends (CRLF, CR) and an event's JSON over several data: lines,
    # cut anywhere between reads (between a CR and its LF too).
    for end in (b"\r\n", b"\r"):
        spread = (b'data: {"usage":' + end + b'data: {"total_tokens": 7}}' + end + end
                  + b"data: [DONE]" + end + end)
        for cut in range(1, len(spread)):
            reader = CostReader("sse:usage.total_tokens")
            reader.feed(spread[:cut])
            reader.feed(spread[cut:])
            assert reader.cost({}) == 7, (end, cut)
    # An event over EVENT_BYTES is not read, nor is its rest: its line's end, the first byte
    # of the next read, is no blank line ending it early.
    huge = CostReader("sse:usage.total_tokens")
    huge.feed(b'data: {"usage": {"total_tokens": 3}}\n\ndata: ' + b"x" * (EVENT_BYTES + 10))
    huge.feed(b'\ndata: {"usage": {"total_tokens": 900}}\n\n')
    assert huge.cost({}) == 3
    unended = CostReader("sse:usage.total_tokens")  # no blank line after the last event
    unended.feed(b'data: {"usage": {"total_tokens": 4}}')
    assert unended.cost({}) == 4
    body = CostReader("json:usage.total_tokens")
    body.feed(b'{"usage": {"total_tokens": 9}}')
    assert body.cost({}) == 9


@pytest.mark.backends("single", "cluster")
async def test_caller_gone_before_the_upstream_answers_aborts_the_call(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    host, port = base.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /proxy/llm/embeddings HTTP/1.1\r\nHost: {host}\r\n"
                 f"Authorization: {auth['Authorization']}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 2\r\n\r\n{{}}".encode())
    await writer.drain()
    await until(lambda: settled(mock_stats(llm)["in_flight"] == 1))
    writer.close()
    left = time.monotonic()
    await until(lambda: settled(mock_stats(llm)["in_flight"] == 0), timeout=3)
    assert time.monotonic() - left < 2.0  # at once; a loaded CI machine is given a second more
    (failed,) = await until(lambda: tasks_of(gateway, "failed"), timeout=3)
    view = await gateway.status(auth, failed["task_id"])
    assert view["task_result"] == "caller connection lost"


@pytest.mark.backends("single", "cluster")
async def test_a_stream_settles_its_cost_from_its_usage_event(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """20 units an hour (a fixed window: a sliding per-cost one would pace them; an hour, not
    a minute: a window that turns over mid-test lets the third in). The first
    request reserves all 20 (X-Queue-Cost) and really spends 7
    (2 prompt words + 5 streamed tokens, its last event's usage): the 13 left let the second
    in at once, and nothing is left for a third."""
    auth = await proxied(gateway, llm, cost_from="sse:usage.total_tokens", limits=[
        {"limiter": "fixed_window", "rate": 20, "interval_ms": 3_600_000, "per": "cost"}])
    base = await start_api()
    await start_dispatcher()
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        first = await http.post("/proxy/llm/chat/completions", json=stream,
                                headers={"X-Queue-Cost": "20"})
        assert first.status_code == 200 and '"total_tokens": 7' in first.text
        # Ended before its caller had the last event: no `processing` after the answer.
        done = await gateway.status(auth, first.headers["x-queue-task-id"])
        assert done["task_status"] == "completed", done
        # Its max wait is past the estimate (which takes the recent average cost, 20, for the
        # next admission): it is let in line, and the settled window lets it through at once.
        second = await http.post("/proxy/llm/chat/completions", json=CHAT,
                                 headers={"X-Queue-Cost": "13", "X-Queue-Max-Wait": "7200"})
        assert second.status_code == 200, second.text
        assert int(second.headers["x-queue-waited-ms"]) < 3000
        third = await http.post("/proxy/llm/chat/completions", json=CHAT,
                                headers={"X-Queue-Cost": "1", "X-Queue-Max-Wait": "2"})
        assert third.status_code == 503  # 7 + 13 spent (the JSON answer kept its estimate)


@pytest.mark.backends("single", "cluster")
async def test_a_cancel_before_the_upstream_answers_stops_the_call(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """Its owner cancels the request while the upstream takes 10 s to answer: the cancel frees
    the slot at once, so the call must stop too (within a third of a lease), or it would run
    on beside the next one past the cap of 1. The caller is told `409 task_cancelled`."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    base = await start_api()
    await start_dispatcher()
    httpx.post(f"{llm}/_mock/config", json={"latency_ms": 10_000}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        first = asyncio.ensure_future(http.post("/proxy/llm/chat/completions", json=CHAT))
        (running,) = await until(lambda: tasks_of(gateway, "processing"), timeout=10)

        async def called() -> bool:
            return bool(mock_stats(llm)["in_flight"])

        await until(called)
        cancelled = await gateway.http.post(f"/api/v1/tasks/{running['task_id']}/cancel",
                                            headers=auth)
        assert cancelled.status_code == 200, cancelled.text
        began = time.monotonic()
        got = await first
        assert got.status_code == 409 and got.json()["error"]["code"] == "task_cancelled"
        assert time.monotonic() - began < 3, "not within a third of a lease"
        assert (await gateway.status(auth, running["task_id"]))["task_status"] == "cancelled"


@pytest.mark.backends("single", "cluster")
async def test_a_caller_that_stops_reading_frees_its_slot(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher,
    env: dict[str, str],
) -> None:
    """A caller that asks for 64 MB and reads none of it, its connection left open: once a
    write to it has waited QGW_SEND_TIMEOUT_S (1.5 s here), the call ends, its task `failed`
    for that reason (not as if the upstream had broken off), and the slot goes to the next
    caller."""
    env["QGW_SEND_TIMEOUT_S"] = "1.5"
    auth = await proxied(gateway, llm, max_concurrency=1)
    base = await start_api()
    await start_dispatcher()
    writer = await raw_post(base, auth, "/proxy/llm/big", "X-Mock-Binary: 67108864;seed=1")
    try:
        (stuck,) = await until(lambda: tasks_of(gateway, "processing"), timeout=10)
        (ended,) = await until(lambda: tasks_of(gateway, "failed"), timeout=15)
        assert ended["task_id"] == stuck["task_id"]
        shown = await gateway.http.get(f"/admin/v1/tasks/{ended['task_id']}",
                                       headers=gateway.admin)
        assert "stopped reading" in json.dumps(shown.json()), shown.text
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
            r = await http.post("/proxy/llm/chat/completions", json=CHAT,
                                headers={"X-Queue-Max-Wait": "5"})
            assert r.status_code == 200, r.text
    finally:
        writer.close()


async def test_an_answer_whose_cost_cannot_be_read_still_frees_its_slot(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """A hostile answer where `cost_from` reads a number: JSON nested 5,000 deep (the parser
    gives up), or a number of 400 digits (no float holds it). The caller has it as sent, its
    task ends, and its slot is free for the next (its unread cost keeps the reservation, the
    whole second's units): before, the first held the slot for as long as the process lived
    (its lease renewed, its task never ended)."""
    auth = await proxied(gateway, llm, max_concurrency=1, cost_from="json:usage.total_tokens",
                         limits=[{"limiter": "fixed_window", "rate": 1000,
                                  "interval_ms": 1000, "per": "cost"}])
    base = await start_api()
    await start_dispatcher()
    deep = b"[" * 5000 + b"]" * 5000
    huge = b'{"usage": {"total_tokens": ' + b"9" * 400 + b"}}"
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        for body in (deep, huge):
            r = await http.post("/proxy/llm/hostile", content=b"{}", headers={
                "X-Mock-Body-Base64": base64.b64encode(body).decode(), "X-Queue-Max-Wait": "5"})
            assert r.status_code == 200 and r.content == body, r.text[:300]
            done = await gateway.status(auth, r.headers["x-queue-task-id"])
            assert done["task_status"] == "completed", done


@pytest.mark.backends("single", "cluster")
async def test_a_stream_longer_than_its_lease_keeps_it(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """The lease (3 s here) is renewed while the answer streams, first a third of it in: a
    stream of 4.5 s ends completed with every event relayed, though a dispatcher's reaper,
    which fails a proxied task whose lease lapsed, runs all along."""
    auth = await proxied(gateway, llm)
    await start_dispatcher()
    base = await start_api()
    httpx.post(f"{llm}/_mock/config", json={"chunks": 45, "chunk_ms": 100}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        async with http.stream("POST", "/proxy/llm/chat/completions",
                               json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200
            task_id = r.headers["x-queue-task-id"]
            events = [line async for line in r.aiter_lines() if line.startswith("data:")]
    assert len(events) == 1 + 45 + 1 + 1 and events[-1] == "data: [DONE]"  # role, tokens, stop
    view = await gateway.status(auth, task_id)
    assert view["task_status"] == "completed", view


async def test_a_200_mb_answer_streams_through_in_bounded_memory(
    gateway: Gateway, llm: str, env: dict[str, str], start_dispatcher: StartDispatcher
) -> None:
    """A 200 MB answer relayed whole and byte-exact while the API process relaying it grows by
    less than 32 MB: read and passed on a piece at a time, never held whole."""
    size = 200 << 20
    auth = await proxied(gateway, llm, methods=["GET"], timeout_ms=120_000)
    await start_dispatcher()
    proc, port = await api_process(env)
    try:
        watched = psutil.Process(proc.pid)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=auth,
                                     timeout=120) as http:
            async def fetch(nbytes: int, seed: int) -> bytes:
                h = hashlib.sha256()
                async with http.stream("GET", "/proxy/llm/video", headers={
                        "X-Mock-Binary": f"{nbytes};seed={seed}"}) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_raw():
                        h.update(chunk)
                return h.digest()

            await fetch(2 << 20, 1)  # warm: connections, buffers
            base, stop_watching = watched.memory_info().rss, asyncio.Event()
            peak = asyncio.create_task(peak_rss(watched, stop_watching))
            try:
                digest = await fetch(size, 9)
            finally:
                stop_watching.set()
        assert digest == binary_digest(size, 9)
        growth = await peak - base
        print(f"the API process grew by {growth / 2**20:.1f} MiB relaying {size >> 20} MiB")
        assert growth < 32 << 20, f"the API process grew by {growth / 2**20:.1f} MiB"
    finally:
        stop(proc, timeout=1)
