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
from collections import Counter
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError


class SendTimeout(Exception):
    """A client accepted nothing for the write deadline: the request is abandoned."""


class SendDeadline:
    """ASGI middleware: every `send` of an HTTP answer within `timeout_s` (0: no deadline)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        timeout = self.timeout_s

        async def bounded(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise SendTimeout(f"the client accepted nothing for {timeout:g} s") from None

        await self.app(scope, receive, bounded)


class ReadSlots:
    """How many large results each API key is reading from this process right now."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._held: Counter[str] = Counter()

    def take(self, key_id: str) -> None:
        """A slot for one read; 429 when the key has none left. Give it back with `give`."""
        if self._held[key_id] >= self.per_key:
            raise ApiError(429, "too_many_reads",
                           f"this key already reads {self.per_key} large results at once; "
                           "retry when one has finished", {"Retry-After": "1"})
        self._held[key_id] += 1

    def give(self, key_id: str) -> None:
        self._held[key_id] -= 1
        if self._held[key_id] <= 0:
            del self._held[key_id]


class HeldStream(StreamingResponse):
    """A streamed answer that holds a read slot until it has ended, however it ends."""

    def __init__(self, slots: ReadSlots, key_id: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots, self._key_id = slots, key_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slots.give(self._key_id)
