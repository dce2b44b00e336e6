"""Business API calls over HTTP/1.1: keep-alive connections on asyncio protocols, answers parsed
by httptools (llhttp, the parser uvicorn uses). The dispatcher's calls (`request`: the answer
whole, decoded, or streamed past a size) and the proxy's (`relay`: the answer as sent, handed
on at its headers) share the connections.

Why not aiohttp: a call through its session cost a dispatcher ~145 µs of CPU, through this ~50
(bench/upstream_client.py), and the call was half of a dispatcher's CPU. A call needs little: a
registered URL, the headers it may carry, a body, a cap on the answer's size; no redirects,
cookies, proxies or streamed requests. The caller bounds the whole call with one deadline
(`asyncio.timeout`); a connection a call did not finish with is closed, never reused.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import httptools
from yarl import URL

from app.queue.streams import DECODERS, BodyStream

MAX_HEAD_BYTES = 64 * 1024  # an answer's headers; more is not an answer we take
MAX_INTERIM = 16  # interim (1xx) answers before the real one: an endless stream of them is none
IDLE_S = 4.0  # a connection idle longer is closed, not reused: many servers close theirs after
# 5 s (uvicorn), and a request written just as the server closes would be lost to its call
MAX_IDLE = 64  # kept connections per host: what a burst leaves beyond that is closed
RELAY_HIGH_WATER = 256 << 10  # a relayed answer's bytes held while its caller is slow
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})  # no Content-Length: 0 when empty
# How a call asks for its answer: whole, or (larger than `spill` bytes) as a stream.


class BadAnswer(ConnectionError):
    """The upstream's bytes are not an HTTP answer we take (malformed, cut short, too large a
    head): its connection is closed."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names; the first of repeated ones
    body: bytes | None  # None: over the size cap (the rest was not read), or streamed
    #: An answer larger than the caller's `spill`, or relayed: its body as it arrives (its
    #: connection is the stream's until closed). The reader enforces any size cap.
    stream: BodyStream | None = None
    raw: list[tuple[bytes, bytes]] | None = None  # relayed: the headers as sent, in order


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's requests go, parsed (and percent-encoded as aiohttp's yarl does) once."""

    key: tuple[str, str, int]  # scheme, host, port: the connections it may share
    host_header: str
    path_qs: str


@lru_cache(maxsize=4096)
def target(url: str, query: tuple[tuple[str, str], ...] = ()) -> Target:
    """`url` with `query` added to its own; a ValueError for what cannot be called."""
    u = URL(url)
    if query:
        u = u.extend_query(query)
    if u.scheme not in ("http", "https") or not u.raw_host or u.port is None:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = u.raw_host if ":" not in u.raw_host else f"[{u.raw_host}]"  # IPv6 literal
    default = 443 if u.scheme == "https" else 80
    return Target((u.scheme, u.raw_host, u.port), host if u.port == default else f"{host}:{u.port}",
                  u.raw_path_qs)


class UpstreamClient:
    """Kept-alive connections per scheme, host and port. Their number is bounded by the calls
    in flight, which the dispatcher's slots bound."""

    def __init__(self, user_agent: str) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ua = user_agent
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self, method: str, url: str, query: Sequence[tuple[str, str]],
        headers: list[tuple[str, str]], body: bytes | None, max_bytes: int,
        on_sent: Callable[[], None] | None = None, spill: int | None = None,
    ) -> Answer:
        """One call; `on_sent` runs once the request is written. With `spill`, a body larger
        than that comes as `Answer.stream`: the caller must close it."""
        where = target(url, tuple(query))
        head = self._head(method, where, headers, body, own=True)
        return await self._call(method, where, head, body, max_bytes, on_sent, spill, None)

    def relay_head(self, method: str, url: str, headers: list[tuple[str, str]],
                   body: bytes) -> tuple[Target, bytes]:
        """Where a relayed call goes and its request's head, for `relay` (a ValueError for
        what cannot be sent): built ahead by a caller with time to spare (a proxied request,
        while Redis runs its submit)."""
        where = target(url)
        return where, self._head(method, where, headers, body or None, own=False)

    async def relay(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
                    timeout_s: float, on_sent: Callable[[], None] | None = None,
                    head: tuple[Target, bytes] | None = None) -> Answer:
        """A proxied call: the request with only the headers given (no encoding asked for),
        the answer handed on once its status and headers are in (within `timeout_s`), its
        body as sent (`Answer.stream`, never decoded; no wait for more longer than
        `timeout_s`) and its headers in order (`Answer.raw`). The caller must close the
        stream: a body read to its end leaves the connection kept for the next call.

        A request written into a kept connection the upstream had just closed (no byte of an
        answer came) goes again once on a new one, whatever its method: it carries the task's
        Idempotency-Key, and the caller is waiting on it.

        `head`: relay_head's for this call, if built already (`url` and `headers` are then
        not read again)."""
        where, raw = head or self.relay_head(method, url, headers, body)
        async with asyncio.timeout(timeout_s):
            return await self._call(method, where, raw, body, 0, on_sent, None, timeout_s)

    async def _call(self, method: str, where: Target, head: bytes, body: bytes | None,
                    max_bytes: int, on_sent: Callable[[], None] | None, spill: int | None,
                    relay_idle_s: float | None) -> Answer:
        resend = relay_idle_s is not None or method in IDEMPOTENT
        for retry in (False, True):
            # Sent again on a new connection: an upstream closing idle ones on a timer closes
            # the others kept with it too.
            conn, reused = await self._connection(where, fresh=retry)
            try:
                answer = await conn.exchange(head, body, max_bytes, method == "HEAD", on_sent,
                                             spill, relay_idle_s)
            except BadAnswer:
                conn.close()
                # A kept-alive connection the server closed as this request went out: sent
                # again on a new one where that is safe (aiohttp does the same).
                if reused and not conn.heard and resend and not retry:
                    on_sent = None  # it left once: its window entry moved then
                    continue
                raise
            except BaseException:  # cut short (a timeout): the answer may still come
                conn.close()
                raise
            if answer.stream is not None and conn.streaming:
                conn.home = self, where.key  # the stream holds its connection until closed
                return answer
            self.keep(conn, where.key)
            return answer
        raise AssertionError("unreachable")

    def keep(self, conn: _Connection, key: tuple[str, str, int]) -> None:
        """A connection done with its call: kept for the next if it may be, else closed."""
        if not conn.reusable or self._closed:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        kept = self._idle.setdefault(key, [])
        kept.append(conn)
        if len(kept) > MAX_IDLE:
            kept.pop(0).close()

    def _head(self, method: str, where: Target, headers: list[tuple[str, str]],
              body: bytes | None, own: bool) -> bytes:
        """The request's head; with `own`, the gateway's Accept, User-Agent and
        Accept-Encoding (its calls decode what they ask for) added."""
        given = "".join(name + value for name, value in headers)
        if "\r" in given or "\n" in given or "\0" in given:
            # A caller's header value with a line break would smuggle in headers of its own.
            raise ValueError("a header name or value contains a control character")
        lines = [f"{method} {where.path_qs} HTTP/1.1\r\nHost: {where.host_header}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers)
        if own:
            names = {name.lower() for name, _ in headers}
            if "accept" not in names:
                lines.append("Accept: */*\r\n")
            if "user-agent" not in names:
                lines.append(f"User-Agent: {self._ua}\r\n")
            lines.append("Accept-Encoding: gzip, deflate\r\n")
        if body is not None or method not in _BODYLESS:
            lines.append(f"Content-Length: {len(body or b'')}\r\n")
        lines.append("\r\n")
        # Relayed headers came in as latin-1 and go out byte for byte; what cannot be sent
        # so is a ValueError (UnicodeEncodeError), as a control character is.
        return "".join(lines).encode() if own else "".join(lines).encode("latin-1")

    async def _connection(self, where: Target, fresh: bool = False
                          ) -> tuple[_Connection, bool]:
        """A kept-alive connection (and True), or a new one (always, with `fresh`)."""
        if self._closed:
            raise ConnectionError("the upstream client is closed")
        idle = None if fresh else self._idle.get(where.key)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn, True
            conn.close()
        scheme, host, port = where.key
        tls = self._tls_context() if scheme == "https" else None
        _, conn = await asyncio.get_running_loop().create_connection(
            _Connection, host, port, ssl=tls, server_hostname=host if tls else None)
        return conn, False

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request written, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Answer] | None = None
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._unparsed = 0  # bytes fed since the parser last made progress (data_received)
        self._body = bytearray()
        self._max_bytes = 0
        self._spill: int | None = None
        self._stream: BodyStream | None = None
        self._relay_idle_s: float | None = None  # relaying (and the longest wait for more)
        self._raw: list[tuple[bytes, bytes]] = []  # relaying: the headers as sent
        self._keep_hint = False  # relaying: the answer's head lets the connection be kept
        self.home: tuple[UpstreamClient, tuple[str, str, int]] | None = None  # a stream's
        self._head_done = False  # the final answer's headers are in
        self._framed = False  # Content-Length or chunked: the answer's end is known
        self._head_only = False
        self._interim = False  # a 1xx answer before the real one
        self._interims = 0  # how many came before this answer's real one
        self.idle_since = 0.0
        self._keep = False
        self.lost = False
        self.heard = False  # a byte of an answer came

    @property
    def streaming(self) -> bool:
        """Its answer's body is still coming, through `Answer.stream`."""
        return self._stream is not None

    @property
    def reusable(self) -> bool:
        """Its answer was read to the end, which left the connection open for another."""
        return self._keep and not self.lost

    def usable(self, now: float) -> bool:
        return not self.lost and self._waiter is None and now - self.idle_since < IDLE_S

    def close(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.abort()

    def release(self) -> None:
        """Its stream was read to the end: back to its client for another call if the answer
        left the connection open (a relayed one), else closed."""
        home, self.home, self._stream = self.home, None, None
        if home is None:
            self.close()
        else:
            home[0].keep(self, home[1])

    async def exchange(self, head: bytes, body: bytes | None, max_bytes: int, head_only: bool,
                       on_sent: Callable[[], None] | None, spill: int | None = None,
                       relay_idle_s: float | None = None) -> Answer:
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._headers, self._head_bytes, self._body = {}, 0, bytearray()
        self._unparsed = 0
        self._max_bytes, self._head_only, self._spill = max_bytes, head_only, spill
        self._relay_idle_s, self._stream, self._raw = relay_idle_s, None, []
        self._head_done = self._framed = self._interim = False
        self._interims = 0
        self._keep = self._keep_hint = self.heard = False
        self._transport.write(head + body if body else head)
        if on_sent is not None:
            on_sent()
        try:
            return await self._waiter
        finally:
            self._waiter = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self._waiter is None and self._stream is None:  # bytes nobody asked for (a lying
            # Content-Length, say)
            self.close()
            return
        self.heard = True
        self._unparsed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadAnswer("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, BadAnswer) else exc
            self._fail(BadAnswer(f"not an HTTP answer: {cause}"))
        else:
            # The parser holds a line until it ends (a status line, a header, a trailer, a
            # chunk's size), growing it a read at a time: one with no end would take memory
            # and CPU without bound, long before MAX_HEAD_BYTES counts it.
            if self._unparsed > MAX_HEAD_BYTES:
                self._fail(BadAnswer(f"an answer line over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._stream is not None:
            if exc is None and not self._framed:
                self._stream.end()  # an answer that ends with its connection
            else:
                self._stream.fail(BadAnswer("the upstream closed the connection before its "
                                            "answer ended"))
            return
        if exc is None and self._head_done and not self._framed:
            self._finish(bytes(self._body))  # an answer that ends with its connection
        else:
            self._fail(BadAnswer("the upstream closed the connection before its answer ended"))

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._unparsed = 0
        if self._waiter is None or self._waiter.done():  # a second answer to one request
            self.close()
            raise BadAnswer("an answer nobody asked for")  # stops the parser here
        self._interim = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._unparsed = 0
        if self._head_done:  # a chunked body's trailer: not the answer's headers
            return
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise BadAnswer(f"answer headers over {MAX_HEAD_BYTES} bytes")
        key = name.decode("latin-1").lower()
        if key not in self._headers:
            self._headers[key] = value.decode("latin-1")
        elif key == "transfer-encoding":  # its codings over every line: chunked may be last
            self._headers[key] += ", " + value.decode("latin-1")
        if self._relay_idle_s is not None:
            self._raw.append((bytes(name), bytes(value)))

    def on_headers_complete(self) -> None:
        self._unparsed = 0
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interims += 1
            if self._interims > MAX_INTERIM:  # stops the parser here
                raise BadAnswer(f"more than {MAX_INTERIM} interim (1xx) answers")
            self._interim, self._headers, self._head_bytes, self._raw = True, {}, 0, []
            return
        if not 200 <= status <= 599:  # llhttp takes any three digits; no server would relay it
            raise BadAnswer(f"status {status} is no HTTP status")
        headers = self._headers
        self._head_done = True
        # llhttp reads any other Transfer-Encoding to the connection's end
        self._framed = "content-length" in headers or \
            "chunked" in headers.get("transfer-encoding", "").lower()
        length = _int(headers.get("content-length"))
        if self._relay_idle_s is not None:
            # Read here: once the message is complete the parser has forgotten it.
            self._keep_hint = self._parser.should_keep_alive() and not self._head_only
            self._start_stream(b"")
            if self._head_only and self._stream is not None:  # no body follows, whatever
                self._stream.end()  # its headers say
        elif self._head_only:  # no body follows, whatever its headers say
            self._finish(b"", reusable=False)
        elif status not in (204, 304) and length > self._max_bytes:
            self._finish(None, reusable=False)
        elif self._spill is not None and length > self._spill and status not in (204, 304):
            self._start_stream(b"")

    def on_body(self, chunk: bytes) -> None:
        self._unparsed = 0
        if self._stream is not None:
            self._stream.feed(chunk)
            return
        if self._interim or self._waiter is None or self._waiter.done():
            return
        self._body += chunk
        if self._spill is not None and len(self._body) > self._spill:
            self._start_stream(bytes(self._body))
            self._body = bytearray()
        elif len(self._body) > self._max_bytes:
            self._finish(None, reusable=False)
            self.close()

    def on_message_complete(self) -> None:
        self._unparsed = 0
        if self._interim:
            return
        if self._stream is not None:
            self._keep = self._keep_hint  # a relayed answer, read to its end
            self._stream.end()
            return
        self._finish(bytes(self._body), reusable=self._parser.should_keep_alive())

    def _finish(self, raw: bytes | None, reusable: bool = False) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        self._keep = reusable
        encoding = self._headers.get("content-encoding")
        cap = self._max_bytes if self._spill is None else min(self._spill, self._max_bytes)
        try:
            body = _decoded(raw, encoding, cap)
        except zlib.error as exc:
            waiter.set_exception(BadAnswer(f"answer body not as encoded: {exc}"))
            return
        if body is None and raw and self._spill is not None:
            # Small compressed, large decoded: decoded bit by bit as its reader takes it.
            stream = BodyStream(None, encoding, raw, BadAnswer)
            waiter.set_result(Answer(self._parser.get_status_code(), dict(self._headers), None,
                                     stream))
            return
        waiter.set_result(Answer(self._parser.get_status_code(), dict(self._headers), body))

    def _start_stream(self, prefix: bytes) -> None:
        """Hand the answer on now, its body to follow through a stream (larger than spill)."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        self._keep = False
        if self._relay_idle_s is None:
            self._stream = BodyStream(self, self._headers.get("content-encoding"), prefix,
                                      BadAnswer)
            waiter.set_result(Answer(self._parser.get_status_code(), dict(self._headers), None,
                                     self._stream))
            return
        self._stream = BodyStream(self, None, prefix, BadAnswer, self._relay_idle_s,
                                  RELAY_HIGH_WATER)
        waiter.set_result(Answer(self._parser.get_status_code(), self._headers, None,
                                 self._stream, self._raw))

    # the stream's source (app/queue/streams.py)

    def pause(self) -> None:
        if self._transport is not None and not self.lost:
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._transport is not None and not self.lost:
            self._transport.resume_reading()

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _decoded(raw: bytes | None, encoding: str | None, max_bytes: int) -> bytes | None:
    """The body with its Content-Encoding undone (gzip, deflate), None past `max_bytes`."""
    wbits = DECODERS.get((encoding or "").strip().lower())
    if raw is None or wbits is None or not raw:
        return raw
    inflate = zlib.decompressobj(wbits)
    out = inflate.decompress(raw, max_bytes + 1)
    if len(out) > max_bytes or inflate.unconsumed_tail:
        return None
    if not inflate.eof:
        raise zlib.error("the compressed body is cut short")
    return out
