"""One upstream call whose answer is handed on as it arrives: status and headers first, then the
body a read at a time (pulled: nothing more is read from the socket than the caller has taken,
so memory stays bounded whatever the answer's size, and a slow caller slows the upstream through
TCP). The body goes on as the upstream sent it (no decoding: its Content-Encoding goes along).

One connection a call, closed after it: a proxied call is the whole of its slot's work, and a
connection cut half-way through a stream (a caller gone) could never be reused anyway.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from functools import lru_cache

import httptools

from app.queue.http1 import MAX_HEAD_BYTES, BadAnswer, target

READ_BYTES = 64 * 1024


@lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


class Streamed:
    """An answer under way: `status`, `headers` (as sent, in order), then `body()` once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 idle_s: float) -> None:
        self._reader, self._writer, self._idle_s = reader, writer, idle_s
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_done = self._ended = self._interim = False
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
            if self._head_done and not self._framed():
                self._ended = True  # an answer that ends with its connection
                return
            raise BadAnswer("the upstream closed the connection before its answer ended")
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

    def close(self) -> None:
        """Done with it: the connection closes, which aborts the call if it was still on."""
        self._ended = True
        self._writer.transport.abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._interim = False

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

    def on_body(self, chunk: bytes) -> None:
        if not self._interim:
            self._chunks.append(bytes(chunk))

    def on_message_complete(self) -> None:
        if not self._interim:
            self._ended = True


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
    scheme, host, port = where.key
    tls = _tls() if scheme == "https" else None
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None, limit=READ_BYTES)
    lines = [f"{method} {where.path_qs} HTTP/1.1\r\nHost: {where.host_header}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("Connection: close\r\n\r\n")
    answer = Streamed(reader, writer, timeout_s)
    try:
        writer.write("".join(lines).encode("latin-1") + body)
        if on_sent is not None:
            on_sent()
        await answer._head(method == "HEAD")
    except BaseException:
        answer.close()
        raise
    return answer
