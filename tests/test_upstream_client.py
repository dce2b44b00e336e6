"""The upstream HTTP client (app/queue/upstream.py) against a hostile or odd business API.

Each upstream is a loopback TCP server writing scripted raw HTTP/1.1 bytes, so the tests hold for
any client behind `upstream_client` / `call` / `client.close()`: they are its contract.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.queue.http1 import BadAnswer
from app.queue.upstream import Outcome, Request, call, upstream_client

#: What the server does with one request: raw bytes to write (the connection stays open), or a
#: coroutine given the request's raw bytes and the writer (it may sleep, trickle, close).
Answer = bytes | Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT_S = 1.0
MAX_BYTES = 1000


def ok(body: bytes, *headers: str) -> bytes:
    """A 200 with a Content-Length and `headers` ("Name: value")."""
    head = "".join(f"{h}\r\n" for h in (*headers, f"Content-Length: {len(body)}"))
    return f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + body


def closing(data: bytes) -> Answer:
    """Writes `data` then closes the connection."""
    async def answer(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        writer.close()
    return answer


@dataclass
class Upstream:
    """Answers the n-th request (over all connections) with answers[n], the last one again
    past the end; keeps each request's raw bytes and counts connections."""

    answers: list[Answer]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while not writer.is_closing():
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                raw = head + await reader.readexactly(length)
                self.requests.append(raw)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                else:
                    await answer(raw, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()

    def heads(self) -> list[dict[str, str]]:
        """Each request's headers, names in lower case."""
        return [dict((k.strip().lower(), v.strip()) for k, _, v in
                     (line.decode().partition(":") for line in r.split(b"\r\n\r\n")[0]
                      .split(b"\r\n")[1:])) for r in self.requests]


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    """Starts loopback upstreams: `await upstream(answer, ...)`."""
    started: list[tuple[asyncio.Server, Upstream]] = []

    async def start(*answers: Answer) -> Upstream:
        up = Upstream(list(answers))
        server = await asyncio.start_server(up.serve, "127.0.0.1", 0)
        up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        started.append((server, up))
        return up

    yield start
    for server, up in started:
        server.close()
        for task in up.tasks:
            task.cancel()


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    http = upstream_client()
    yield http
    await http.close()


def req(url: str, method: str = "POST", body: str = "", headers: str = "{}",
        query: str = "{}", **kw: Any) -> Request:
    return Request(method=method, url=url, headers=headers, query=query, body=body, **kw)


async def timed(client: Any, request: Request, timeout_s: float = TIMEOUT_S,
                max_bytes: int = MAX_BYTES, **kw: Any) -> tuple[Outcome, float]:
    began = time.monotonic()
    out = await call(client, "task-1", request, timeout_s, max_bytes, **kw)
    return out, time.monotonic() - began


async def hold(_: bytes, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # cancelled at teardown


# 1-2: answers too large -------------------------------------------------------------------

async def test_a_declared_length_over_max_bytes_is_refused_before_the_body(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    async def head_only(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000000\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # the body never comes

    up = await upstream(head_only)
    out, took = await timed(client, req(f"{up.url}/big"))
    assert out.refused and not out.ok and not out.retryable
    assert out.text == f"upstream answer over {MAX_BYTES} bytes: not kept"
    assert took < TIMEOUT_S / 2


async def test_an_endless_chunked_body_is_refused_once_over_max_bytes(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    async def endless(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"100\r\n" + b"x" * 256 + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.001)

    up = await upstream(endless)
    out, took = await timed(client, req(f"{up.url}/stream"))
    assert out.refused and out.text == f"upstream answer over {MAX_BYTES} bytes: not kept"
    assert took < TIMEOUT_S / 2


# 3-4: no answer, a partial one ----------------------------------------------------------

async def test_no_answer_times_out_and_is_retried(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(hold)
    out, took = await timed(client, req(f"{up.url}/silent"), timeout_s=0.5)
    assert out.status_code is None and out.retryable and not out.refused
    assert out.text.startswith("upstream timed out after")
    assert 0.45 < took < 1.5


async def test_a_body_trickling_past_the_timeout_times_out(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """The timeout is for the whole call, not for each read."""
    async def trickle(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _byte in range(100):
            await asyncio.sleep(0.05)
            writer.write(b"x")
            await writer.drain()

    up = await upstream(trickle)
    out, took = await timed(client, req(f"{up.url}/slow"), timeout_s=0.5)
    assert out.status_code is None and out.retryable
    assert out.text.startswith("upstream timed out after")
    assert took < 1.5


async def test_a_body_shorter_than_its_content_length_is_an_error(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(closing(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789"))
    out, took = await timed(client, req(f"{up.url}/short"))
    assert out.status_code is None and out.retryable and not out.ok
    assert "0123456789" not in out.text
    assert took < TIMEOUT_S / 2


# 5-10: framing -----------------------------------------------------------------------------

SMUGGLED = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"


async def test_bytes_past_the_content_length_are_never_the_next_answer(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Extra bytes after a declared length (here a whole response) are not read as the answer
    to the next call on the same client."""
    up = await upstream(ok(b"first") + SMUGGLED, ok(b"second"))
    first, _ = await timed(client, req(f"{up.url}/a"))
    second, _ = await timed(client, req(f"{up.url}/b"))
    assert (first.status_code, first.text) == (200, "first")
    assert (second.status_code, second.text) == (200, "second")
    assert len(up.requests) == 2


async def test_an_answer_nobody_asked_for_never_answers_the_next_call(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """The same bytes arriving while the connection waits idle: aiohttp's pool read them as the
    next call's answer, and every later answer on that connection came one call late (another
    task's result, maybe another user's)."""
    async def late_extra(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"first"))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(SMUGGLED)
        await writer.drain()

    up = await upstream(late_extra, ok(b"second"), ok(b"third"))
    first, _ = await timed(client, req(f"{up.url}/a"))
    await asyncio.sleep(0.3)
    second, _ = await timed(client, req(f"{up.url}/b"))
    third, _ = await timed(client, req(f"{up.url}/c"))
    assert [o.text for o in (first, second, third)] == ["first", "second", "third"]


async def test_garbage_instead_of_http_is_an_error(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(b"HELLO\r\n\r\n")
    out, _ = await timed(client, req(f"{up.url}/x"))
    assert out.status_code is None and not out.ok


async def test_a_body_without_length_is_read_until_the_connection_closes(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    body = b"line\n" * 100
    up = await upstream(closing(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body))
    out, _ = await timed(client, req(f"{up.url}/eof"))
    assert out.ok and out.text == body.decode()


async def test_a_head_answer_has_no_body_and_the_connection_goes_on(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", ok(b"after"))
    head, took = await timed(client, req(f"{up.url}/h", method="HEAD"))
    assert head.ok and head.text == "" and took < TIMEOUT_S / 2
    after, _ = await timed(client, req(f"{up.url}/g", method="GET"))
    assert after.ok and after.text == "after"
    assert [r.split(b" ")[0] for r in up.requests] == [b"HEAD", b"GET"]


async def test_a_gzip_body_is_decoded(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(ok(gzip.compress(b'{"done": true}'), "Content-Encoding: gzip"))
    out, _ = await timed(client, req(f"{up.url}/gz"))
    assert out.ok and out.text == '{"done": true}'


async def test_an_interim_100_continue_is_skipped(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"final"))
    out, _ = await timed(client, req(f"{up.url}/c", body="data"))
    assert (out.status_code, out.text) == (200, "final")


@pytest.mark.parametrize("status", [b"999", b"600", b"099"])
async def test_a_status_no_http_answer_has_is_an_error(
    upstream: Callable[..., Awaitable[Upstream]], client: Any, status: bytes
) -> None:
    """llhttp takes any three digits: a status the gateway's own server cannot write back
    (the proxy relays it) is no answer."""
    up = await upstream(b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 2\r\n\r\nok")
    out, _ = await timed(client, req(f"{up.url}/odd"))
    assert out.status_code is None and not out.ok and f"status {int(status)} " in out.text


async def test_endless_interim_answers_are_an_error_at_once(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """A flood of 1xx answers never gets to a real one: refused after a few, not read (a core
    busy) until the endpoint's timeout."""
    up = await upstream(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" * 100_000)
    out, took = await timed(client, req(f"{up.url}/hints"))
    assert out.status_code is None and not out.ok and "interim" in out.text
    assert took < TIMEOUT_S / 2


# 11-12: headers ---------------------------------------------------------------------------

@pytest.mark.parametrize("status, name", [(503, "Retry-After"), (429, "RETRY-AFTER")])
async def test_retry_after_is_read_whatever_its_case(
    upstream: Callable[..., Awaitable[Upstream]], client: Any, status: int, name: str
) -> None:
    """A wait in whole seconds is rounded up to the clock's whole second (signals.pause_s):
    the endpoint pauses that long and the call is retried when the pause ends."""
    up = await upstream(f"HTTP/1.1 {status} Busy\r\n{name}: 7\r\nContent-Length: 4\r\n\r\nbusy"
                        .encode())
    out, _ = await timed(client, req(f"{up.url}/busy"))
    assert out.status_code == status and out.text == "busy" and out.retryable
    assert out.retry_after_s is not None and 6 < out.retry_after_s <= 7.01
    assert out.pause_s == out.retry_after_s


async def test_text_in_another_charset_is_kept_in_base64(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Only valid UTF-8 is kept as text: another charset's bytes are kept as they came."""
    up = await upstream(ok(b"caf\xe9", "Content-Type: text/plain; charset=latin-1"))
    out, _ = await timed(client, req(f"{up.url}/l1"))
    assert out.ok and out.meta is not None and out.meta.encoding == "base64"
    assert base64.b64decode(out.text) == b"caf\xe9"


@pytest.mark.parametrize("shape", ["one-line", "many-lines"])
async def test_a_megabyte_of_headers_is_an_error(
    upstream: Callable[..., Awaitable[Upstream]], client: Any, shape: str
) -> None:
    fields = (f"X-Big: {'a' * 1_000_000}\r\n" if shape == "one-line" else
              "".join(f"X-H{i}: {'a' * 1000}\r\n" for i in range(1000)))
    up = await upstream(f"HTTP/1.1 200 OK\r\n{fields}Content-Length: 2\r\n\r\nhi".encode())
    out, took = await timed(client, req(f"{up.url}/hdr"))
    assert not out.ok and (out.status_code is None or out.refused)
    assert took < TIMEOUT_S


def endless_line(prefix: bytes, sent: list[int]) -> Answer:
    """`prefix`, then a line that never ends, as fast as the client takes it."""
    async def answer(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(prefix)
        while True:
            writer.write(b"a" * 65536)
            await writer.drain()
            sent[0] += 65536
    return answer


@pytest.mark.parametrize("prefix", [
    b"HTTP/1.1 200 ",  # the reason phrase
    b"HTTP/1.1 200 OK\r\nX-Endless: ",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailer: ",
], ids=["status", "header", "trailer"])
async def test_a_line_without_end_is_refused_without_being_held(
    upstream: Callable[..., Awaitable[Upstream]], client: Any, prefix: bytes
) -> None:
    """The parser holds a line until it ends, growing it a read at a time: one that never
    ends took memory and CPU without bound until the timeout. Refused once over
    MAX_HEAD_BYTES, the connection closed, the upstream stopped a few reads later."""
    sent = [0]
    up = await upstream(endless_line(prefix, sent))
    out, took = await timed(client, req(f"{up.url}/line"))
    assert not out.ok and took < TIMEOUT_S / 2, (out, took)
    assert sent[0] < 16 << 20, sent[0]  # what loopback's buffers hold, not all it could send
    sent[0] = 0
    relayed = await upstream(endless_line(prefix, sent))
    with pytest.raises(BadAnswer):
        answer = await client.relay("GET", f"{relayed.url}/line", [], b"", TIMEOUT_S)
        await body_of(answer)
    assert sent[0] < 16 << 20, sent[0]


# 13, 15, 16: the request -------------------------------------------------------------------

async def test_a_header_value_with_cr_lf_is_never_sent(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(ok(b"sent"))
    evil = json.dumps({"x-trace": ["a\r\nX-Evil: 1"]})
    out, took = await timed(client, req(f"{up.url}/inj", headers=evil,
                                        allowed=frozenset({"x-trace"})))
    assert out.refused and not out.retryable and out.status_code is None
    assert out.text.startswith("request cannot be sent")
    assert took < TIMEOUT_S / 2
    await asyncio.sleep(0.05)
    assert not any(b"x-evil" in r.lower() for r in up.requests)


async def test_the_request_is_sent_as_given(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Method, path, the URL's query then the stored one (encoded as yarl does), Host, the
    Idempotency-Key, the exact body, and of the caller's headers only those allowed."""
    up = await upstream(ok(b"done"))
    headers = {"Content-Type": ["application/json"], "X-Tenant": ["t1"], "X-Trace": ["t2"],
               "Authorization": ["Bearer secret"]}
    body = '{"prompt": "café"}'
    query = json.dumps({"q": ["a b"], "r": ["é&"], "s": ["/?#+="]})
    out, _ = await timed(client, req(f"{up.url}/api/gen?size=1&n=2", method="PATCH", body=body,
                                     headers=json.dumps(headers), query=query,
                                     allowed=frozenset({"content-type", "x-tenant"})))
    assert out.ok and out.text == "done"
    (raw,) = up.requests
    head, _, sent = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == (
        b"PATCH /api/gen?size=1&n=2&q=a+b&r=%C3%A9%26&s=/?%23%2B%3D HTTP/1.1")
    assert sent == body.encode()
    (got,) = up.heads()
    port = up.url.rsplit(":", 1)[1]
    assert got["host"] == f"127.0.0.1:{port}"
    assert got["idempotency-key"] == "task-1"
    assert got["content-length"] == str(len(body.encode()))
    assert got["content-type"] == "application/json" and got["x-tenant"] == "t1"
    generic = {"accept", "accept-encoding", "user-agent", "connection"}  # the client's own
    assert set(got) - generic == {"host", "idempotency-key", "content-length", "content-type",
                                  "x-tenant"}


async def test_a_call_without_body_sends_none(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """No body bytes; a POST still says Content-Length: 0 (RFC 9110 8.6: a user agent sends it
    in a POST even when 0; some servers answer a POST without one 411 Length Required)."""
    up = await upstream(ok(b"got"))
    for method in ("GET", "POST"):
        out, _ = await timed(client, req(f"{up.url}/list", method=method))
        assert out.ok and out.text == "got"
    get, post = up.requests
    assert get.startswith(b"GET /list HTTP/1.1\r\n") and get.endswith(b"\r\n\r\n")
    assert post.startswith(b"POST /list HTTP/1.1\r\n") and post.endswith(b"\r\n\r\n")
    assert up.heads()[0].get("content-length", "0") == "0"
    assert up.heads()[1]["content-length"] == "0"


async def test_on_sent_runs_once_before_the_answer(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    sent: list[float] = []
    seen_before_answer: list[int] = []

    async def late(_: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.1)
        seen_before_answer.append(len(sent))
        writer.write(ok(b"late"))
        await writer.drain()

    up = await upstream(late)
    out, _ = await timed(client, req(f"{up.url}/s", body="x"),
                         on_sent=lambda: sent.append(time.monotonic()))
    assert out.ok and out.text == "late"
    assert seen_before_answer == [1] and len(sent) == 1


# 14: keep-alive ------------------------------------------------------------------------------

async def test_sequential_calls_share_one_connection(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    up = await upstream(ok(b"same"))
    outs = [(await timed(client, req(f"{up.url}/k{i}")))[0] for i in range(3)]
    assert [o.text for o in outs] == ["same"] * 3
    assert up.connections == 1 and len(up.requests) == 3


@pytest.mark.parametrize("first", [
    closing(ok(b"one", "Connection: close")), closing(ok(b"one"))],
    ids=["connection-close", "just-closed"])
async def test_a_connection_closed_by_the_upstream_is_not_reused(
    upstream: Callable[..., Awaitable[Upstream]], client: Any, first: Answer
) -> None:
    up = await upstream(first, ok(b"two"))
    one, _ = await timed(client, req(f"{up.url}/1"))
    await asyncio.sleep(0.1)  # the upstream's idle close reaches the client
    two, _ = await timed(client, req(f"{up.url}/2"))
    assert (one.text, two.text) == ("one", "two") and one.ok and two.ok
    assert up.connections == 2


def resetting(data: bytes) -> Answer:
    """Writes `data` then resets the connection (SO_LINGER 0: an RST, not a FIN)."""
    async def answer(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    return answer


async def test_answers_are_what_their_framing_and_status_say(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """A body without a length cut by a reset is an error, not a shorter success; a 204 may
    declare any length (it has no body); a Transfer-Encoding other than chunked is read to the
    connection's end; the headers of bytes past an answer never join it; chunked framing is
    read over every Transfer-Encoding line."""
    up = await upstream(resetting(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart"))
    cut, _ = await timed(client, req(f"{up.url}/a"))
    assert cut.status_code is None and cut.retryable

    up = await upstream(b"HTTP/1.1 204 No Content\r\nContent-Length: 5000000\r\n\r\n",
                        closing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nall"))
    empty, _ = await timed(client, req(f"{up.url}/b"))
    assert (empty.status_code, empty.text, empty.refused) == (204, "", False)
    whole, _ = await timed(client, req(f"{up.url}/c"))
    assert (whole.status_code, whole.text) == (200, "all")

    extra = b"HTTP/1.1 200 OK\r\nRetry-After: 9\r\nContent-Length: 1\r\n\r\nx"
    up = await upstream(ok(b"first") + extra)
    first, _ = await timed(client, req(f"{up.url}/d"))
    assert (first.text, first.retry_after_s) == ("first", None)

    # Two Transfer-Encoding lines, chunked the last coding: the body is chunked, so a close
    # before its last chunk is a cut answer, never a whole one.
    up = await upstream(closing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))
    two, _ = await timed(client, req(f"{up.url}/e"))
    assert two.status_code is None and two.retryable, two


# the proxy's relayed calls (UpstreamClient.relay) ---------------------------------------------

async def body_of(answer: Any) -> bytes:
    return b"".join([piece async for piece in answer.stream])


async def test_a_relayed_answer_comes_at_its_headers_as_sent_and_keeps_its_connection(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Handed on at its head (the body still to come), its headers in order with repeats (a
    trailer not among them), its body as encoded; the request with only the headers given;
    read to its end, its connection serves the next call."""
    packed = gzip.compress(b"event one\n\nevent two\n\n")
    go = asyncio.Event()

    async def slow(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nContent-Encoding: gzip\r\n"
                     b"Set-Cookie: b=2\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(packed), packed))
        await writer.drain()

    up = await upstream(slow, ok(b"second"))
    answer = await client.relay("POST", f"{up.url}/v1/chat", [("X-Caller", "c")], b"{}", 5.0)
    assert answer.status == 200 and answer.raw == [
        (b"Set-Cookie", b"a=1"), (b"Content-Encoding", b"gzip"), (b"Set-Cookie", b"b=2"),
        (b"Transfer-Encoding", b"chunked")]
    assert not answer.stream.at_end
    go.set()
    assert await body_of(answer) == packed and answer.stream.at_end
    assert len(answer.raw) == 4 and "x-trailer" not in answer.headers  # not the answer's
    answer.stream.close()
    second = await client.relay("GET", f"{up.url}/v1/models", [], b"", 5.0)
    assert second.status == 200 and await body_of(second) == b"second"
    second.stream.close()
    assert up.connections == 1
    first, again = up.heads()
    assert set(first) == {"host", "x-caller", "content-length"}  # nothing of the gateway's own
    assert set(again) == {"host"}  # a GET without a body says no length


async def test_a_relayed_answer_cut_half_way_closes_its_connection(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    async def half(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf.")
        await writer.drain()
        await asyncio.sleep(30)  # cancelled at teardown

    up = await upstream(half, ok(b"next"))
    answer = await client.relay("POST", f"{up.url}/a", [], b"", 5.0)
    async for piece in answer.stream:
        assert piece == b"half."
        break
    answer.stream.close()
    after = await client.relay("POST", f"{up.url}/b", [], b"", 5.0)
    assert await body_of(after) == b"next"
    after.stream.close()
    assert up.connections == 2


async def test_a_relayed_body_that_stalls_times_out_per_wait(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Each wait for more is bounded by the timeout, not the whole answer: a stream that keeps
    coming goes on past it, one that stalls ends."""
    async def trickle(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _piece in range(8):
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        await asyncio.sleep(30)  # then stalls; cancelled at teardown

    up = await upstream(trickle)
    answer = await client.relay("GET", f"{up.url}/s", [], b"", 0.4)
    got, began = b"", time.monotonic()
    with pytest.raises(TimeoutError):
        async for piece in answer.stream:
            got += piece
    assert got == b"x" * 8 and 1.0 < time.monotonic() - began < 2.5
    answer.stream.close()


async def test_a_relayed_body_nobody_reads_stops_the_upstream(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """Memory bounded whatever the answer's size: past RELAY_HIGH_WATER bytes waiting, the
    connection stops reading, and TCP stops the upstream's writes."""
    sent = 0

    async def endless(_: bytes, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        while True:
            writer.write(b"x" * 65536)
            await writer.drain()
            sent += 65536

    up = await upstream(endless)
    answer = await client.relay("GET", f"{up.url}/big", [], b"", 5.0)
    await asyncio.sleep(0.5)
    stalled = sent
    await asyncio.sleep(0.3)
    # The upstream is stopped, having sent what the two sockets' buffers hold beyond ours.
    assert sent == stalled and sent < 64 << 20, sent
    read = 0
    async for piece in answer.stream:
        read += len(piece)
        if read > sent + (8 << 20):  # it reads on again once the caller does
            break
    answer.stream.close()
    assert sent > stalled


async def test_a_relayed_call_met_by_a_closing_kept_connection_goes_again_on_a_new_one(
    upstream: Callable[..., Awaitable[Upstream]], client: Any
) -> None:
    """The upstream closes its kept connection as the next request arrives, answering nothing:
    a relayed POST goes again, once, on a new connection (it carries the task's
    Idempotency-Key); a queued call's POST does not (the dispatcher's retry policy decides)."""
    async def drop(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.close()

    up = await upstream(ok(b"one"), drop, ok(b"two"))
    first = await client.relay("POST", f"{up.url}/a", [], b"{}", 5.0)
    assert await body_of(first) == b"one"
    first.stream.close()
    again = await client.relay("POST", f"{up.url}/b", [], b"{}", 5.0)
    assert await body_of(again) == b"two"
    again.stream.close()
    assert up.connections == 2 and len(up.requests) == 3

    up = await upstream(ok(b"one"), drop, ok(b"two"))
    one, _ = await timed(client, req(f"{up.url}/c"))
    dropped, _ = await timed(client, req(f"{up.url}/d"))
    assert one.text == "one" and dropped.status_code is None and len(up.requests) == 2
