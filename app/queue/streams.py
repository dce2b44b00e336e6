"""An answer's body handed on as it arrives (app/queue/http1.py): answers too large to hold,
and the proxy's relayed ones.

The connection feeds raw chunks in; the reader takes them out, decoded (gzip, deflate) in
bounded pieces, or as sent when not decoded: then what arrived together leaves together (the
events of one read in one piece, a send for them all). Flow control keeps memory bounded
whatever the upstream's speed: past its high water bytes waiting, the connection stops reading
from its socket (TCP then slows the sender) until the reader has brought them under a quarter
of it.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

HIGH_WATER = 1 << 20
PIECE = 1 << 20  # at most this much decoded output per piece (a small gzip may inflate a lot)
DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Source(Protocol):
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...
    def release(self) -> None: ...  # the body was read to its end: kept if it may be


class BodyStream:
    """The body of one answer; iterate it once (`async for chunk in stream`), then `close`."""

    def __init__(self, source: Source | None, encoding: str | None, prefix: bytes,
                 error: type[Exception], idle_s: float | None = None,
                 high_water: int = HIGH_WATER) -> None:
        self._source = source
        self._idle_s = idle_s  # the longest wait for more (None: the caller's deadline)
        self._high, self._low = high_water, high_water // 4
        self._chunks: deque[bytes] = deque([prefix] if prefix else [])
        self._buffered = len(prefix)
        self._ended = source is None  # no source: the whole body is in `prefix`
        self._failure: Exception | None = None
        self._wake: asyncio.Future[None] | None = None
        self._paused = False
        self._error = error
        wbits = DECODERS.get((encoding or "").strip().lower())
        self._inflate = zlib.decompressobj(wbits) if wbits else None

    # the connection's side

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > self._high and not self._paused and self._source is not None:
            self._paused = True
            self._source.pause()
        self._notify()

    def end(self) -> None:
        self._ended = True
        self._notify()

    def fail(self, exc: Exception) -> None:
        if not self._ended:
            self._failure = exc
            self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # the reader's side

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                if self._inflate is None and len(self._chunks) > 1:
                    raw = b"".join(self._chunks)
                    self._chunks.clear()
                else:
                    raw = self._chunks.popleft()
                self._buffered -= len(raw)
                if self._paused and self._buffered < self._low and self._source is not None:
                    self._paused = False
                    self._source.resume()
                for piece in self._decoded(raw):
                    yield piece
            elif self._failure is not None:
                raise self._failure
            elif self._ended:
                if self._inflate is not None and not self._inflate.eof:
                    raise self._error("the compressed body is cut short")
                return
            else:
                self._wake = asyncio.get_running_loop().create_future()
                if self._idle_s is None:
                    await self._wake
                else:
                    async with asyncio.timeout(self._idle_s):
                        await self._wake
                self._wake = None

    @property
    def ready(self) -> bool:
        """A read would not wait: a piece is here, or the end (not a failure: raised once
        read)."""
        return bool(self._chunks) or self._ended

    @property
    def at_end(self) -> bool:
        """What was handed out last was the body's end: nothing more will come."""
        return self._ended and not self._chunks and self._failure is None

    def _decoded(self, raw: bytes) -> Iterator[bytes]:
        """`raw` decoded, one bounded piece at a time (handed on before the next is made)."""
        inflate = self._inflate
        if inflate is None:
            yield raw
            return
        try:
            data = inflate.decompress(raw, PIECE)
            while data:
                yield data
                tail = inflate.unconsumed_tail
                data = inflate.decompress(tail, PIECE) if tail else b""
        except zlib.error as exc:
            raise self._error(f"answer body not as encoded: {exc}") from None

    def close(self) -> None:
        """Done with it: a body read to its end lets its connection go back for another call
        where the connection may (app/queue/http1.py); any other is closed, which aborts the
        call if it was still on."""
        if self._source is not None:
            if self.at_end:
                self._source.release()
            else:
                self._source.close()
            self._source = None
        self._chunks.clear()
