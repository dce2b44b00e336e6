"""Answers have a write deadline (QGW_SEND_TIMEOUT_S), and each API key a bound on the large
results it reads at once (QGW_MAX_LARGE_READS_PER_KEY).

A client that accepts no bytes for QGW_SEND_TIMEOUT_S holds what the process wrote for it and
the request's task: each `send` of an answer must complete within the deadline, else the
request ends there (the server then closes its connection). Large results are streamed
(app/routes/results.py), so what a stalled reader pins is one chunk and the socket's buffers,
not the body; and one key's parallel reads of large results are bounded per process, so they
cannot take the process's bandwidth and CPU from everybody else (429 with Retry-After beyond).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.answer_cache import AnswerCache
from app.errors import ApiError

log = logging.getLogger(__name__)
NO_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close resets, unsent bytes dropped


class SendTimeout(Exception):
    """A client accepted nothing for the write deadline: the request is abandoned."""


class SendDeadline:
    """ASGI middleware: every `send` of an HTTP answer within `timeout_s` (0: no deadline).

    Wraps the whole app, as the server runs it (app/cli.py), so that the `send` it sees is the
    server's own and its connection can be aborted: closing it would wait for the unread
    answer to drain first, which a client that reads nothing never lets happen, and the
    socket with everything written to it stayed open for as long as the client liked."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        timeout = self.timeout_s
        # uvicorn's send waits only while its transport has paused writing; otherwise it
        # writes and returns at once, and a deadline (a timer armed and cancelled, a tenth of
        # a proxied request's CPU with the other wrappers) would bound nothing.
        flow = getattr(getattr(send, "__self__", None), "flow", None)

        async def bounded(message: Message) -> None:
            if flow is not None and not flow.write_paused:
                await send(message)
                return
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                _abort(send)
                raise SendTimeout(f"the client accepted nothing for {timeout:g} s") from None

        try:
            await self.app(scope, receive, bounded)
        except SendTimeout as exc:
            log.info("answer abandoned: %s", exc, extra={"path": scope.get("path")})
            # One turn of the loop: the server sees its connection lost (no error logged
            # for an answer left unfinished).
            await asyncio.sleep(0)


def _abort(send: Send) -> None:
    """Drop the connection now, its unsent bytes with it: uvicorn's `send` is a method of its
    request cycle, which holds the transport. Lingering off, the kernel drops what its send
    buffer still holds too (a reset, not megabytes delivered late). Any other server: left to
    close it."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, NO_LINGER)
    transport.abort()


class ReadSlots:
    """How many large results each API key is reading from this process right now.

    A read beyond the key's bound waits up to `wait_s` for a slot before its 429: answering at
    once made the refusals a flood of their own (96 connections of one key re-asking as fast
    as they were refused took the event loop from everybody else), while a refusal that comes
    after a wait costs a connection a timer, not CPU."""

    def __init__(self, per_key: int, wait_s: float = 1.0) -> None:
        self.per_key, self.wait_s = per_key, wait_s
        self._keys: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    async def take(self, key_id: str) -> None:
        """A slot for one read, within `wait_s`, else 429. Give it back with `give`."""
        sem, users = self._keys.get(key_id) or self._keys.setdefault(
            key_id, (asyncio.Semaphore(self.per_key), [0]))
        users[0] += 1
        if not sem.locked():
            await sem.acquire()  # free: returns at once
            return
        try:
            async with asyncio.timeout(self.wait_s):
                await sem.acquire()
        except BaseException as exc:
            self._left(key_id, users)
            if not isinstance(exc, TimeoutError):
                raise
            raise ApiError(429, "too_many_reads",
                           f"this key already reads {self.per_key} large results at once; "
                           "retry when one has finished", {"Retry-After": "1"}) from None

    def give(self, key_id: str) -> None:
        sem, users = self._keys[key_id]
        sem.release()
        self._left(key_id, users)

    def _left(self, key_id: str, users: list[int]) -> None:
        users[0] -= 1
        if users[0] <= 0:
            del self._keys[key_id]


class ClosingStream(StreamingResponse):
    """A streamed answer whose generator is closed as soon as the answer ends, however it
    ends: one abandoned at a send deadline would otherwise run its `finally` (a read slot it
    took on its own, app/routes/follow.py) only once garbage collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if (aclose := getattr(self.body_iterator, "aclose", None)) is not None:
                await aclose()


class HeldStream(ClosingStream):
    """A streamed answer that holds a read slot until it has ended, however it ends, and
    `pinned`'s answer bytes (app/answer_cache.py) if given: `(cache, key)`."""

    def __init__(self, slots: ReadSlots, key_id: str, *args: Any,
                 pinned: tuple[AnswerCache, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots, self._key_id, self._pinned = slots, key_id, pinned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slots.give(self._key_id)
            if self._pinned is not None:
                self._pinned[0].unpin(self._pinned[1])
