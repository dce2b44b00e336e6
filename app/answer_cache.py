"""Encoded status answers of finished tasks with large inline results, per API process, and
the process's memory budget for the answers its large reads hold.

With QGW_RESULT_INLINE_BYTES raised, a status answer may carry megabytes. Built per read, each
one cost Redis the copy out of the hash and the event loop its decoding, validation and JSON
encoding (tens of milliseconds without a pause): 96 connections of one key re-reading an 8 MB
task took the process from everybody (their submits answered 503). A finished task's answer
no longer changes, so it is encoded once and kept here, bounded in bytes, oldest use out
first; a read checks the task (owner, status) with a status call that leaves the result in
Redis, and sends these bytes. One fill per task at a time: reads that miss together wait for
the first instead of each pulling the megabytes.

A read streams its answer from these bytes for as long as its client takes: evicted or not,
they stay referenced until it ends. Stalled readers of distinct tasks (64 sockets on 64 tasks
of 8 MB: +555 MiB) each held their own, so every large read pins its answer here (`pin`, one
count per task however many read it) and the bytes pinned, fills in progress included, plus
the unpinned ones kept, stay within `max_bytes`: a read that would go beyond waits up to a
second for room, then is answered 429 too_many_reads; eviction takes only unpinned answers."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from app.errors import ApiError

#: What all the answers of one process may take together, kept or pinned by a read.
MAX_BYTES = 64 << 20


class AnswerCache:
    def __init__(self, max_bytes: int = MAX_BYTES, wait_s: float = 1.0) -> None:
        self.max_bytes, self.size, self.wait_s = max_bytes, 0, wait_s
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._filling: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._pins: dict[str, list[int]] = {}  # key: [bytes, reads holding it]
        self.pinned = 0  # bytes of the pinned answers (estimates while they are filled)
        self._waiting: list[asyncio.Future[None]] = []  # reads waiting for room

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
        self._trim()

    def held(self) -> int:
        """Bytes this process's large answers take: pinned ones and unpinned kept ones."""
        return self.pinned + sum(len(body) for key, (_, body) in self._entries.items()
                                 if key not in self._pins)

    async def pin(self, key: str, need: int) -> None:
        """Room for one read of `key`'s answer (`need` bytes, an estimate until `settle`),
        within `wait_s`, else 429; held until `unpin`. Reads of a pinned key share its pin."""
        if (pin := self._pins.get(key)) is None and not self._fits(need):
            try:
                async with asyncio.timeout(self.wait_s):
                    while key not in self._pins and not self._fits(need):
                        await self._change()
            except TimeoutError:
                raise ApiError(429, "too_many_reads",
                               f"this process already holds {self.max_bytes >> 20} MiB of "
                               "large answers for readers; retry when one has finished",
                               {"Retry-After": "1"}) from None
            pin = self._pins.get(key)
        if pin is not None:
            pin[1] += 1
            return
        self._pins[key] = [need, 1]
        self.pinned += need
        self._trim()

    def settle(self, key: str, size: int) -> None:
        """The pinned answer's real size, once built."""
        pin = self._pins[key]
        self.pinned += size - pin[0]
        pin[0] = size
        self._trim()
        self._wake()

    def unpin(self, key: str) -> None:
        pin = self._pins[key]
        pin[1] -= 1
        if pin[1] > 0:
            return
        del self._pins[key]
        self.pinned -= pin[0]
        self._trim()
        self._wake()

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

    def _fits(self, need: int) -> bool:
        """Room for `need` more pinned bytes (unpinned kept ones make way); one answer larger
        than the whole budget is let through alone, else it could never be read."""
        return not self.pinned or self.pinned + need <= self.max_bytes

    async def _change(self) -> None:
        """Until a pin is given back or shrinks."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _trim(self) -> None:
        """Oldest unpinned answers out until pinned and kept fit; pinned ones stay."""
        for key in [k for k in self._entries if k not in self._pins]:
            if self.held() <= self.max_bytes:
                return
            self._drop(key)

    def _drop(self, task_id: str) -> None:
        entry = self._entries.pop(task_id, None)
        if entry is not None:
            self.size -= len(entry[1])
