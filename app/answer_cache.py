"""Encoded status answers of finished tasks with large inline results, per API process.

With QGW_RESULT_INLINE_BYTES raised, a status answer may carry megabytes. Built per read, each
one cost Redis the copy out of the hash and the event loop its decoding, validation and JSON
encoding (tens of milliseconds without a pause): 96 connections of one key re-reading an 8 MB
task took the process from everybody (their submits answered 503). A finished task's answer
no longer changes, so it is encoded once and kept here, bounded in bytes, oldest use out
first; a read checks the task (owner, status) with a status call that leaves the result in
Redis, and sends these bytes. One fill per task at a time: reads that miss together wait for
the first instead of each pulling the megabytes."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

#: What all the copies of one process may take together.
MAX_BYTES = 64 << 20


class AnswerCache:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes, self.size = max_bytes, 0
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._filling: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def get(self, task_id: str, version: str) -> bytes | None:
        """The task's answer if kept for this version of it (status, end, attempts)."""
        entry = self._entries.get(task_id)
        if entry is None or entry[0] != version:
            return None
        self._entries.move_to_end(task_id)
        return entry[1]

    def put(self, task_id: str, version: str, body: bytes) -> None:
        self._drop(task_id)
        if len(body) > self.max_bytes:
            return
        self._entries[task_id] = (version, body)
        self.size += len(body)
        while self.size > self.max_bytes:
            self._drop(next(iter(self._entries)))

    @asynccontextmanager
    async def filling(self, task_id: str) -> AsyncIterator[None]:
        """Held while one read builds the task's answer; others wait, then find it kept."""
        lock, users = self._filling.setdefault(task_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:  # the last one out
                del self._filling[task_id]

    def _drop(self, task_id: str) -> None:
        entry = self._entries.pop(task_id, None)
        if entry is not None:
            self.size -= len(entry[1])
