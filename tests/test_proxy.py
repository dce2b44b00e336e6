"""The drop-in proxy (app/proxy/, app/routes/proxy.py): one line and one budget with queued
tasks, the caller's key kept, paths kept under target_url, the queue headers."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from app.core.registry import SPREAD_S
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import QGW, TLS, free_port, mock_log, mock_upstream, stop, wait_port

StartApi = Callable[[], Awaitable[str]]
StartDispatcher = Callable[[], Awaitable[Runtime]]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def openai_server() -> Iterator[str]:
    with mock_upstream("--openai", "--chunks", "5") as base:
        yield base


@pytest.fixture
def llm(openai_server: str) -> str:
    httpx.post(f"{openai_server}/_mock/reset", verify=TLS).raise_for_status()
    return openai_server


async def settled(value: Any) -> Any:
    """`value`, as an awaitable (for `until` with a condition that needs no await)."""
    return value


async def tasks_of(gateway: Gateway, status: str, endpoint: str = "llm"
                   ) -> list[dict[str, Any]]:
    """An endpoint's tasks of one status, as the admin listing has them."""
    r = await gateway.http.get(f"/admin/v1/endpoints/{endpoint}/tasks",
                               params={"status": status}, headers=gateway.admin)
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["tasks"]
    return items


def mock_stats(base: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{base}/_mock/stats", verify=TLS).json()
    return stats


async def raw_status(base: str, path: str, key: str) -> int:
    """The status of a POST to `path` sent as it is (an HTTP client would normalise it)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\n"
                 "Content-Length: 2\r\nConnection: close\r\n\r\n{}".encode())
    line = await reader.readline()
    writer.close()
    return int(line.split()[1])


async def until(check: Callable[[], Awaitable[Any]], timeout: float = 10) -> Any:
    """`check()`'s first true value, asked every 50 ms for up to `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await check()):
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)
    return value


async def proxied(gateway: Gateway, llm: str, **fields: Any) -> dict[str, str]:
    """An endpoint `llm` open to the proxy in front of the mock's /v1; a key for it."""
    await gateway.add_endpoint("llm", f"{llm}/v1", proxy=True, forward_headers=[], **fields)
    return await gateway.new_key(max_priority=10)


@pytest.mark.backends("single", "cluster")
async def test_queued_tasks_and_proxied_calls_share_the_cap(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """The upstream holds its calls: 3 queued tasks in flight, then 3 proxied requests (one
    fits), then 3 more queued tasks: 4 in flight, both kinds among them, never a fifth. Once
    released, all are served, with never more than 4 at once."""
    auth = await proxied(gateway, llm, max_concurrency=4)
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    base = await start_api()
    await start_dispatcher()

    async def in_flight(n: int) -> bool:
        return bool(mock_stats(llm)["in_flight"] == n)

    queued = [(await gateway.submit(auth, f"{llm}/v1"))["task_id"] for _ in range(3)]
    await until(lambda: in_flight(3))
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        proxying = asyncio.gather(*(
            http.post("/proxy/llm/chat/completions", json=CHAT) for _ in range(3)))
        await until(lambda: in_flight(4))
        queued += [(await gateway.submit(auth, f"{llm}/v1"))["task_id"] for _ in range(3)]
        await asyncio.sleep(1)  # time enough for a fifth, were one let through
        held = mock_log(llm)
        assert mock_stats(llm)["in_flight"] == 4 and len(held) == 4
        assert sorted(cast(str, e["path"]) for e in held) == ["/v1"] * 3 + ["/v1/chat/completions"]
        httpx.post(f"{llm}/_mock/release").raise_for_status()
        answers = await proxying
    assert [r.status_code for r in answers] == [200] * 3, answers[0].text
    assert answers[0].json()["object"] == "chat.completion"
    done = await gateway.wait_finished(auth, queued)
    assert {d["task_status"] for d in done} == {"completed"}
    assert mock_stats(llm)["peak_in_flight"] == 4  # reached, never passed
    # Each proxied request was a task of the endpoint, finished through the ack path.
    tid = answers[0].headers["x-queue-task-id"]
    assert int(answers[0].headers["x-queue-waited-ms"]) >= 0
    view = await gateway.status(auth, tid)
    assert view["task_type"] == "proxy" and view["task_status"] == "completed"
    assert view["result_status_code"] == 200


@pytest.mark.backends("single", "cluster")
async def test_a_repeated_idempotency_key_is_not_called_again(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """The caller's Idempotency-Key names its task, as for a submit: a repeat is not called
    again but answered 409 `duplicate_request` with the first task's id (its answer went to
    the first connection); another key is a new call. The upstream gets the task's id."""
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        once = {"Idempotency-Key": "order-17"}
        first = await http.post("/proxy/llm/chat/completions", json=CHAT, headers=once)
        again = await http.post("/proxy/llm/chat/completions", json=CHAT, headers=once)
        other = await http.post("/proxy/llm/chat/completions", json=CHAT,
                                headers={"Idempotency-Key": "order-18"})
        bad = await http.post("/proxy/llm/chat/completions", json=CHAT,
                              headers={"Idempotency-Key": "x" * 129})
    assert first.status_code == 200 and other.status_code == 200, first.text
    assert again.status_code == 409, again.text
    error = again.json()["error"]
    assert error["code"] == "duplicate_request"
    assert error["task_id"] == first.headers["x-queue-task-id"]
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"
    assert [e["idempotency_key"] for e in mock_log(llm)] == [
        first.headers["x-queue-task-id"], other.headers["x-queue-task-id"]]


@pytest.mark.backends("single", "cluster")
async def test_a_request_that_waited_calls_with_the_endpoint_as_it_is_when_admitted(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """The endpoint moved (target_url) and its upstream_headers rotated in one edit while a
    proxied request waits in line (cap 1, the upstream held): its call goes to the new URL
    with the new key, as a dispatcher's call of a queued task would; never the new key to the
    old host. The request admitted before the edit kept both old ones."""
    auth = await proxied(gateway, llm, max_concurrency=1,
                         upstream_headers={"Authorization": "Bearer sk-old"})
    base = await start_api()
    await start_dispatcher()
    httpx.post(f"{llm}/_mock/config", json={"hold": True}).raise_for_status()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        first = asyncio.ensure_future(http.post("/proxy/llm/chat/completions", json=CHAT))
        for _ in range(100):
            if mock_stats(llm)["in_flight"] == 1:
                break
            await asyncio.sleep(0.1)
        second = asyncio.ensure_future(http.post("/proxy/llm/chat/completions", json=CHAT))
        await asyncio.sleep(0.5)  # in line behind the held call
        moved = llm.replace("127.0.0.1", "localhost")  # the same mock, by another name
        r = await gateway.http.patch("/admin/v1/endpoints/llm", headers=gateway.admin, json={
            "target_url": f"{moved}/v1", "upstream_headers": {"Authorization": "Bearer sk-new"}})
        assert r.status_code == 200, r.text
        await asyncio.sleep(SPREAD_S)  # the edit reaches the API process
        assert not second.done()
        httpx.post(f"{llm}/_mock/release").raise_for_status()
        answers = await asyncio.gather(first, second)
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert int(answers[1].headers["x-queue-waited-ms"]) > 500
    sent = [(e["headers"]["host"].split(":")[0], e["headers"]["authorization"])  # type: ignore[index]
            for e in mock_log(llm)]
    assert sent == [("127.0.0.1", "Bearer sk-old"), ("localhost", "Bearer sk-new")]


async def test_key_consumed_headers_forwarded_and_paths_kept_under_target(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    auth = await proxied(gateway, llm, upstream_headers={"Authorization": "Bearer sk-provider"})
    base = await start_api()
    await start_dispatcher()
    key = auth["Authorization"].removeprefix("Bearer ")
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        r = await http.post("/proxy/llm/embeddings?x=1", json={"input": "a b"},
                            headers={"X-API-Key": key, "OpenAI-Beta": "v2",
                                     "X-Queue-Priority": "3", "Cookie": "gw=1"})
        assert r.status_code == 200, r.text
        (entry,) = mock_log(llm)
        assert entry["path"] == "/v1/embeddings" and entry["query"] == {"x": "1"}
        sent = entry["headers"]
        assert isinstance(sent, dict)
        assert "x-api-key" not in sent and "cookie" not in sent
        assert sent["authorization"] == "Bearer sk-provider"  # the endpoint's, not the caller's
        assert sent["openai-beta"] == "v2" and "x-queue-priority" not in sent
        assert entry["idempotency_key"] == r.headers["x-queue-task-id"]
        # The gateway's own answer headers are its own: an upstream's are dropped.
        forged = {"X-Queue-Task-Id": "forged", "X-Queue-Waited-Ms": "99999", "X-Queue-Xyz": "1"}
        r = await http.post("/proxy/llm/embeddings", json={"input": "a"}, headers={
            "X-API-Key": key, "X-Mock-Reply-Headers": json.dumps(forged)})
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-queue-task-id") == [mock_log(llm)[-1]["idempotency_key"]]
        assert len(r.headers.get_list("x-queue-waited-ms")) == 1
        assert r.headers["x-queue-waited-ms"] != "99999" and "x-queue-xyz" not in r.headers
        for bad in ("../x", "a/../../x", "a%2Fb", "a%2fb", "a;b", "a%5Cb", "a\\b", "%2e%2e/x",
                    "a%00", "./x"):
            assert await raw_status(base, f"/proxy/llm/{bad}", key) == 404, bad
        # The endpoint's id escaped: never the bare target_url (the path after it was lost).
        assert await raw_status(base, "/proxy/ll%6D/chat/completions", key) == 404
        assert len(mock_log(llm)) == 2  # none of them was called
        r = await http.post("/proxy/llm/chat/completions", json=CHAT,
                            headers={**auth, "X-Queue-Priority": "11"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
        for name, value in (("X-Queue-Priority", "x"), ("X-Queue-Max-Wait", "0"),
                            ("X-Queue-Cost", "-1")):
            r = await http.post("/proxy/llm/chat/completions", json=CHAT,
                                headers={**auth, name: value})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"
        r = await http.get("/proxy/llm/models", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = await http.post("/proxy/llm/embeddings", json={}, headers={"X-API-Key": "nope"})
        assert r.status_code == 401
    await gateway.add_endpoint("plain", f"{llm}/plain")
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        await asyncio.sleep(1.2)  # the api process hears of the new endpoint
        r = await http.post("/proxy/plain/x", json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "endpoint_not_registered"


@pytest.mark.backends("single", "cluster")
async def test_max_wait_ends_in_503_with_retry_after(
    gateway: Gateway, llm: str, start_api: StartApi
) -> None:
    # Paused by its operator: nothing is admitted (with no dispatcher either, the API process
    # admits a request first in line itself).
    auth = await proxied(gateway, llm, paused=True)
    base = await start_api()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/llm/chat/completions", json=CHAT,
                            headers={"X-Queue-Max-Wait": "0.5"})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "wait_exceeded"
    assert int(r.headers["retry-after"]) >= 1 and error["wait_time"] >= 1
    assert mock_log(llm) == []
    # Its task ended as one whose max wait ran out does (not `cancelled`: nobody cancelled it).
    shown = await gateway.http.get(f"/admin/v1/tasks/{error['task_id']}", headers=gateway.admin)
    assert shown.json()["task_status"] == "expired", shown.text


@pytest.mark.backends("single", "cluster")
async def test_an_upstream_that_keeps_pausing_it_ends_in_503_at_its_max_wait(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """Each call refused with a pause (429, Retry-After: 1) sends the request back in line,
    never to its caller as a 429; at its max wait the caller gets 503 wait_exceeded."""
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()
    refuse = {"X-Mock-Status": "429", "X-Mock-Reply-Headers": '{"retry-after": "1"}',
              "X-Queue-Max-Wait": "3"}
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/llm/chat/completions", json=CHAT, headers=refuse)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "wait_exceeded" and r.headers["retry-after"]
    calls = mock_log(llm)
    assert len(calls) >= 2 and {e["status"] for e in calls} == {429}  # paused, tried again


@pytest.mark.backends("single", "cluster")
async def test_first_in_line_is_admitted_by_its_api_process_under_the_same_rules(
    gateway: Gateway, llm: str, start_api: StartApi
) -> None:
    """No dispatcher runs. A request first in line is claimed by the API process holding it
    (one round trip rather than a dispatcher's wake, claim and event), by the rules a
    dispatcher's claim follows: a limit of 2 a minute (paced: one each 30 s) admits the
    first; the next is refused by it, and its claim leaves it to the dispatchers as theirs
    would (the endpoint scheduled for when the limit admits again, no wake marker to have a
    dispatcher's claim refused at once): it waits, and is never called."""
    auth = await proxied(gateway, llm, rate=2, interval_ms=60_000)
    base = await start_api()
    k, redis = gateway.rt.keys, gateway.rt.redis
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/llm/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert await redis.zscore(k.wake("llm"), "llm") is None  # no dispatcher needed
        second = asyncio.ensure_future(http.post("/proxy/llm/chat/completions", json=CHAT))
        for _ in range(100):
            if (due := await redis.zscore(k.delayed("llm"), "llm")) is not None:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the refused claim scheduled nothing")
        (secs, micros) = await redis.time()
        assert 20_000 < due - (secs * 1000 + micros // 1000) <= 30_000  # the pace's next slot
        assert await redis.zscore(k.wake("llm"), "llm") is None
        stats = await redis.hgetall(k.stats("llm"))
        assert int(stats["admitted"]) == 1 and int(stats["limited"]) == 1, stats
        assert not second.done()
        second.cancel()
    assert len(mock_log(llm)) == 1


async def test_calls_one_after_another_need_no_dispatcher(
    gateway: Gateway, llm: str, start_api: StartApi
) -> None:
    """A cap of 1 and no dispatcher: each call, first in line once the one before it has
    ended, is admitted by its own API process, as the one before's ack reaches Redis before
    its caller's last bytes. Also for a process whose Redis has not the ack script cached
    (flushed here, as by a restart): its first ack met NOSCRIPT and ran again only after the
    next call's claim had found the slot still taken, which left that call to dispatchers
    (none here: it waited out its max wait). Single Redis: a Cluster's
    ack is awaited before the last bytes anyway."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    for _ in range(3):  # a process each time: its first ack is the one at stake
        await gateway.rt.redis.script_flush()
        base = await start_api()
        async with httpx.AsyncClient(base_url=base, timeout=30, headers={
                **auth, "X-Queue-Max-Wait": "5"}) as http:
            for _ in range(2):
                r = await http.post("/proxy/llm/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
    assert len(mock_log(llm)) == 6


@pytest.mark.backends("single", "cluster")
async def test_rate_limit_headers_on_an_answer_hold_the_next_calls(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """A 200 saying its upstream takes one more call before a reset 2 s away: of the two
    calls that follow at once, one goes, the other waits for the reset. Then a 200 saying
    none remain pauses the endpoint until its reset: the next call waits for it. As with a
    dispatcher's answers (app/queue/acks.py); the proxy used to drop both signals, and the
    upstream saw the calls it had just said it would refuse."""
    auth = await proxied(gateway, llm)
    base = await start_api()
    await start_dispatcher()  # admits what waited

    def told(left: int) -> dict[str, str]:
        return {"X-Mock-Reply-Headers": json.dumps({
            "x-ratelimit-remaining-requests": str(left), "x-ratelimit-reset-requests": "2s"})}

    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        async def call(headers: dict[str, str] | None = None) -> None:
            r = await http.post("/proxy/llm/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 200, r.text

        await call(told(1))
        await asyncio.gather(call(), call())
        await call(told(0))
        await call()
    t = [float(e["t"]) for e in mock_log(llm)]  # type: ignore[arg-type]
    assert len(t) == 5
    assert t[1] - t[0] < 1000 and t[2] - t[0] > 1000  # one at once, one after the reset
    assert t[4] - t[3] > 1000  # paused until the reset (a whole 2 s, aligned to the second)


async def test_upstream_connections_are_kept_for_the_next_call(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """An answer read to its end leaves its connection for the next call (app/queue/http1.py);
    a call cut half-way closes its own."""
    auth = await proxied(gateway, llm, max_concurrency=1)
    base = await start_api()
    await start_dispatcher()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        for body in (CHAT, {**CHAT, "stream": True}, CHAT):
            r = await http.post("/proxy/llm/chat/completions", json=body)
            assert r.status_code == 200, r.text
        httpx.post(f"{llm}/_mock/config", json={"chunk_ms": 200}).raise_for_status()
        async with http.stream("POST", "/proxy/llm/chat/completions",
                               json={**CHAT, "stream": True}) as cut:
            assert cut.status_code == 200  # closed at its head: the call is cut
        httpx.post(f"{llm}/_mock/config", json={"chunk_ms": 0}).raise_for_status()
        await asyncio.sleep(0.5)
        r = await http.post("/proxy/llm/chat/completions", json=CHAT)
        assert r.status_code == 200
    peers = [tuple(cast("list[str | int]", e["peer"])) for e in mock_log(llm)]  # [host, port]
    assert len(peers) == 5 and len(set(peers[:4])) == 1  # one connection, kept
    assert peers[4] != peers[3]  # the cut one was closed, not kept


async def test_a_head_request_has_no_body_and_the_next_call_goes_on(
    gateway: Gateway, llm: str, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """HEAD: the upstream's status and headers, no body (whatever its Content-Length says),
    the task completed; its connection is not kept (no body follows to tell where the answer
    ends), so the next call goes on a new one and is answered whole."""
    auth = await proxied(gateway, llm, methods=["HEAD", "POST"])
    base = await start_api()
    await start_dispatcher()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        head = await http.head("/proxy/llm/models")
        assert head.status_code == 200 and head.content == b"", head.content
        assert int(head.headers["content-length"]) > 0
        done = await gateway.status(auth, head.headers["x-queue-task-id"])
        assert done["task_status"] == "completed", done
        r = await http.post("/proxy/llm/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    calls = mock_log(llm)
    assert [c["method"] for c in calls] == ["HEAD", "POST"]
    assert calls[0]["peer"] != calls[1]["peer"]


async def test_a_304_goes_back_without_a_body_and_the_connection_goes_on(
    gateway: Gateway, start_api: StartApi, start_dispatcher: StartDispatcher
) -> None:
    """A conditional GET answered `304 Not Modified` with the representation's Content-Length
    (RFC 9110 allows it): relayed without that length, which the caller's server would have
    waited for (then cut the connection); the task completed; the next call on the same
    connection is answered. Its Server header is the upstream's; its Date, one only."""
    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\n'
                             b"Date: Wed, 21 Oct 2015 07:28:00 GMT\r\nServer: files/1.0\r\n"
                             b"Content-Length: 1234\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        await gateway.add_endpoint("files", f"http://127.0.0.1:{port}/files", proxy=True,
                                   methods=["GET"], forward_headers=[])
        auth = await gateway.new_key()
        base = await start_api()
        await start_dispatcher()
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=10) as http:
            for _ in range(2):  # one connection: the first answer ended where it should
                r = await http.get("/proxy/files/a.bin", headers={"If-None-Match": '"v1"'})
                assert r.status_code == 304 and r.headers["etag"] == '"v1"', r.headers
                assert "content-length" not in r.headers and r.content == b""
                # One Date, the gateway's; the upstream's Server, and none of the gateway's.
                names = [name for name, _ in r.headers.multi_items()]
                assert names.count("date") == 1 and "2015" not in r.headers["date"]
                assert names.count("server") == 1 and r.headers["server"] == "files/1.0"
                done = await gateway.status(auth, r.headers["x-queue-task-id"])
                assert done["task_status"] == "completed", done
    finally:
        server.close()


def _self_signed(where: Path) -> ssl.SSLContext:
    """A server's TLS context with a certificate for 127.0.0.1 that nobody signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (where / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (where / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(where / "cert.pem", where / "key.pem")
    return ctx


async def test_an_upstream_that_cannot_answer_properly_is_a_502_not_the_callers_fault(
    gateway: Gateway, start_api: StartApi, start_dispatcher: StartDispatcher, tmp_path: Path
) -> None:
    """A certificate nobody signed (ssl's error is a ValueError too: it read as the caller's
    400 invalid_request), and a status no HTTP answer has (999: the caller's server could not
    write it back, and the caller got an empty reply). Both are the upstream's: 502, its task
    failed."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    tls = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=_self_signed(tmp_path))
    odd = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        for eid, server, scheme in (("unsigned", tls, "https"), ("odd", odd, "http")):
            port = server.sockets[0].getsockname()[1]
            await gateway.add_endpoint(eid, f"{scheme}://127.0.0.1:{port}/v1", proxy=True)
        auth = await gateway.new_key()
        base = await start_api()
        await start_dispatcher()
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=10) as http:
            for eid, why in (("unsigned", "CERTIFICATE_VERIFY_FAILED"), ("odd", "status 999")):
                r = await http.post(f"/proxy/{eid}/chat/completions", json=CHAT)
                err = r.json()["error"]
                assert r.status_code == 502 and err["code"] == "upstream_unreachable", r.text
                assert why in err["message"]
                done = await gateway.status(auth, err["task_id"])
                assert done["task_status"] == "failed" and why in done["task_result"], done
    finally:
        tls.close()
        odd.close()


@contextlib.contextmanager
def stalling(proc: subprocess.Popen[bytes], every_s: float, for_s: float) -> Iterator[None]:
    """Stop the process for `for_s` every `every_s` (SIGSTOP / SIGCONT): a busy event loop, a
    long GC pause or a CPU-starved container, made to order."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                done.wait(for_s)
            finally:
                os.kill(proc.pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def most_in_any_window(times_ms: list[float], window_ms: float) -> int:
    times, most, first = sorted(times_ms), 0, 0
    for last, t in enumerate(times):
        while t - times[first] >= window_ms:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.mark.backends("single", "cluster")
async def test_oversubscribed_callers_reach_the_upstream_within_its_limit(
    gateway: Gateway, llm: str, env: dict[str, str], start_dispatcher: StartDispatcher
) -> None:
    """Callers at 3x the endpoint's limit, through an API process that stalls now and then: the
    calls admitted meanwhile leave late, together. Their sliding-window entries move to when
    they left (app/ratelimit/sent.py), as a dispatcher's do, so the upstream, which refuses
    past its limit in a clock second, never has to, and never sees more than the limit in any
    second."""
    limit, seconds = 10, 3  # six stalls; the 90 calls take 9 s at the limit
    auth = await proxied(gateway, llm, rate=limit, interval_ms=1000)
    httpx.post(f"{llm}/_mock/config", json={"rate_per_s": limit}).raise_for_status()
    port = free_port()
    api = subprocess.Popen([*QGW, "api", "--port", str(port)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_port, port, 30.0, api)
        await start_dispatcher()
        async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=120,
                headers={**auth, "X-Queue-Max-Wait": "120"},
                limits=httpx.Limits(max_connections=None)) as http:
            calls = []
            with stalling(api, every_s=0.5, for_s=0.25):
                for _ in range(10 * seconds):  # 3 x limit a second, in tenths of a second
                    calls.append(asyncio.gather(*(
                        http.post("/proxy/llm/chat/completions", json=CHAT)
                        for _ in range(3 * limit // 10))))
                    await asyncio.sleep(0.1)
                answers = [r for batch in await asyncio.gather(*calls) for r in batch]
    finally:
        stop(api)
    assert [r.status_code for r in answers] == [200] * len(answers)
    assert mock_stats(llm)["statuses"] == {"200": len(answers)}  # not one 429
    arrived = [float(e["t"]) for e in mock_log(llm)]  # type: ignore[arg-type]
    # Any second, not only clock seconds; 50 ms off for the way there and a busy mock (a call
    # held back by a stall arrives up to 250 ms late).
    assert most_in_any_window(arrived, 950) <= limit
