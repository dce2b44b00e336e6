"""Kept-alive connections for the proxy's upstream calls, per event loop and scheme, host and
port: a call whose answer was read to its end (framed, the upstream keeping the connection)
leaves its connection here for the next. A new connection a call cost more CPU than any other
step of a proxied call but the submit (the connect, the close, each a trip through the kernel on
both sides), and over TLS a handshake each: a provider's API far away pays round trips too.

A connection cut half-way (a caller gone, a stream broken off, an answer left unread) is closed,
never kept. One idle longer than IDLE_S is closed rather than reused: servers drop idle
connections after a few seconds (5 s is common), and a request written into one being dropped
gets no answer.
"""

from __future__ import annotations

import asyncio
import time

IDLE_S = 4.0
MAX_IDLE = 64  # per host: what a burst leaves behind beyond that is closed

Key = tuple[str, str, int]  # scheme, host, port
Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_idle: dict[Key, list[tuple[float, asyncio.AbstractEventLoop, Conn]]] = {}


def take(key: Key) -> Conn | None:
    """A kept connection to `key` that looks alive (the newest first), or None."""
    kept = _idle.get(key)
    if not kept:
        return None
    loop, now = asyncio.get_running_loop(), time.monotonic()
    while kept:
        since, owner, (reader, writer) = kept.pop()
        if owner is loop and now - since < IDLE_S and not reader.at_eof() \
                and not writer.is_closing():
            return reader, writer
        if owner is loop:  # another loop's (a test's, gone) is left to the collector
            writer.transport.abort()
    return None


def give(key: Key, conn: Conn) -> None:
    kept = _idle.setdefault(key, [])
    kept.append((time.monotonic(), asyncio.get_running_loop(), conn))
    while len(kept) > MAX_IDLE:
        _, owner, (_, writer) = kept.pop(0)
        if owner is asyncio.get_running_loop():
            writer.transport.abort()
