"""One upstream call whose answer is handed on as it arrives: status and headers first, then the
body a read at a time (pulled: nothing more is read from the socket than the caller has taken,
so memory stays bounded whatever the answer's size, and a slow caller slows the upstream through
TCP). The body goes on as the upstream sent it (no decoding: its Content-Encoding goes along).

A connection whose answer was read to its end goes back to the pool (app/proxy/pool.py) for
the next call to the same upstream; one cut half-way (a caller gone) is closed. A request
written into a kept connection the upstream had just closed (nothing of an answer came back)
goes again once on a new one, as HTTP/1.1 clients do.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from functools import lru_cache

import httptools

from app.proxy import pool
from app.queue.http1 import MAX_HEAD_BYTES, BadAnswer, target

READ_BYTES = 64 * 1024


@lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


class Streamed:
    """An answer under way: `status`, `headers` (as sent, in order), then `body()` once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 idle_s: float, key: pool.Key) -> None:
        self._reader, self._writer, self._idle_s, self._key = reader, writer, idle_s, key
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_done = self._ended = self._interim = False
        self.heard = False  # a byte of an answer came
        self._complete = False  # its whole message was read, and nothing after it
        self._keep = False  # the upstream keeps the connection (HTTP/1.1, no `close`)
        self._chunks: list[bytes] = []

    async def _head(self, head_only: bool) -> None:
        while not self._head_done:
            await self._feed()
        if head_only:
            self._ended = True

    async def _feed(self) -> None:
        async with asyncio.timeout(self._idle_s):
            data = await self._reader.read(READ_BYTES)
        if not data:
            self._complete = False
            if self._head_done and not self._framed():
                self._ended = True  # an answer that ends with its connection
                return
            raise BadAnswer("the upstream closed the connection before its answer ended")
        self.heard = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, BadAnswer) else exc
            raise BadAnswer(f"not an HTTP answer: {cause}") from None

    def _framed(self) -> bool:
        names = {name.lower(): value for name, value in self.headers}
        return b"content-length" in names or b"chunked" in names.get(
            b"transfer-encoding", b"").lower()

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come; raises BadAnswer (or TimeoutError: no byte for the
        endpoint's timeout) when it breaks off."""
        while True:
            if self._chunks:
                # What one read brought comes on as one piece: events that arrived together
                # leave together, and a stream of small events costs a send a read, not each.
                chunks, self._chunks = self._chunks, []
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif self._ended:
                return
            else:
                await self._feed()

    @property
    def at_end(self) -> bool:
        """The body's last bytes were handed out: nothing more will come."""
        return self._ended and not self._chunks

    def close(self) -> None:
        """Done with it: a connection whose answer was read to its end, that the upstream
        keeps open, goes back to the pool; any other closes, which aborts the call if it was
        still on."""
        self._ended = True
        if self._complete and self._keep:
            self._complete = False  # once
            pool.give(self._key, (self._reader, self._writer))
        else:
            self._writer.transport.abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._interim = False
        self._complete = False  # bytes after the answer: the connection is not kept

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise BadAnswer(f"answer headers over {MAX_HEAD_BYTES} bytes")
        self.headers.append((bytes(name), bytes(value)))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self._interim, self.headers, self._head_bytes = True, [], 0
            return
        self.status, self._head_done = status, True
        # Read here: once the message is complete the parser has forgotten it.
        self._keep = self._parser.should_keep_alive()

    def on_body(self, chunk: bytes) -> None:
        if not self._interim:
            self._chunks.append(bytes(chunk))

    def on_message_complete(self) -> None:
        if not self._interim:
            self._ended = self._complete = True


async def open_call(method: str, url: str, headers: list[tuple[str, str]], body: bytes,
                    timeout_s: float, on_sent: Callable[[], None] | None = None) -> Streamed:
    """Send the request and wait for the answer's status and headers (within `timeout_s`,
    which also bounds each wait for more of the body); `on_sent` is called once the request
    has left. ValueError for a request that cannot be sent, OSError / BadAnswer /
    TimeoutError for an upstream that does not answer."""
    where = target(url)
    given = "".join(name + value for name, value in headers)
    if "\r" in given or "\n" in given or "\0" in given:
        raise ValueError("a header name or value contains a control character")
    lines = [f"{method} {where.path_qs} HTTP/1.1\r\nHost: {where.host_header}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    request = "".join(lines).encode("latin-1") + body
    once = _once(on_sent)
    kept = pool.take(where.key)
    if kept is not None:
        answer = await _exchange(kept, where.key, request, method, timeout_s, once, True)
        if answer is not None:
            return answer
    scheme, host, port = where.key
    tls = _tls() if scheme == "https" else None
    async with asyncio.timeout(timeout_s):
        conn = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None, limit=READ_BYTES)
    answer = await _exchange(conn, where.key, request, method, timeout_s, once, False)
    assert answer is not None
    return answer


async def _exchange(conn: pool.Conn, key: pool.Key, request: bytes, method: str,
                    timeout_s: float, on_sent: Callable[[], None], kept: bool
                    ) -> Streamed | None:
    """The request on `conn`, the answer's head read; None when `conn` was a kept one the
    upstream had closed meanwhile (no byte of an answer came): send it again on a new one."""
    reader, writer = conn
    answer = Streamed(reader, writer, timeout_s, key)
    try:
        writer.write(request)
        on_sent()
        await answer._head(method == "HEAD")
    except TimeoutError:
        answer.close()
        raise
    except (OSError, BadAnswer):
        answer.close()
        if kept and not answer.heard:
            return None
        raise
    except BaseException:
        answer.close()
        raise
    return answer


def _once(on_sent: Callable[[], None] | None) -> Callable[[], None]:
    """`on_sent` at the first send only (a request sent again after a dead kept connection
    left the first time; its window entry must not move twice)."""
    fired = on_sent is None

    def sent() -> None:
        nonlocal fired
        if not fired:
            fired = True
            assert on_sent is not None
            on_sent()
    return sent
