"""Which API processes still hold the callers of their proxied requests.

A proxied request waits in line as a task while one API process holds its caller's connection.
When that process dies (kill -9, an OOM kill, its node lost), nobody is left to make the call;
yet a dispatcher's claim would admit the task, and its slot would stay taken until its lease
lapsed: a whole lease for each orphan, an endpoint shut for minutes behind a crashed pod's
waiting requests.

So each API process keeps one marker per endpoint while it holds proxied requests there
(`Keys.owner`: a key with a TTL on the Redis clock, its lease but at most `MAX_TTL_MS`, written
again every fifth of it), and each such task names its marker and its TTL (fields `owner`,
`owner_ms`). A claim (lua/claim-12.lua) then:
- ends a proxy task whose marker is gone `failed` ("caller connection lost") without admitting
  it, once the task is older than `owner_ms` (a new marker's first write may still be on its way);
- gives one it admits a lease of `owner_ms` only (a pickup lease), which its process renews to a
  whole lease a third of the way in (app/proxy/relay.py): one admitted just before its process
  died frees its slot that soon, not a whole lease later.

A process stalled for longer than the TTL loses its waiting requests (`failed`), as one stalled
past its lease loses its calls. Costs: a `SET` per endpoint every 2 s while requests wait there
(every fifth of the TTL); nothing in a request's own path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.core.keys import Keys

log = logging.getLogger(__name__)
#: The markers' TTL: a process's lease (QGW_LEASE_MS), at most this. Long enough that a Redis
#: failover (seconds) loses no live marker, with its renewal every fifth of it.
MAX_TTL_MS = 10_000


class Owners:
    def __init__(self, redis: Redis, keys: Keys, ident: str, lease_ms: int) -> None:
        self.redis, self.keys = redis, keys
        self.ttl_ms = min(lease_ms, MAX_TTL_MS)
        self.renew_s = self.ttl_ms / 5000
        # Not the process ident alone: a process restarted under the same pid and hostname (a
        # container's) must not pass for the one whose requests it never held.
        self.instance = f"{ident}.{os.urandom(4).hex()}"
        self._held: Counter[str] = Counter()
        self._written: dict[str, float] = {}  # monotonic: each endpoint's marker's last write
        self._renewing: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Future[Any]] = set()  # under way (kept from the GC)

    def marker(self, endpoint: str) -> tuple[str, int]:
        """The marker a proxied request's task names, and its TTL (ms): its fields `owner` and
        `owner_ms`."""
        return self.keys.owner(endpoint, self.instance), self.ttl_ms

    def hold(self, endpoint: str) -> None:
        """A proxied request of `endpoint` is in this process from now: its marker is kept."""
        self._held[endpoint] += 1
        now, last = time.monotonic(), self._written.get(endpoint)
        if last is None or now - last >= self.renew_s:
            # Not awaited: the task's own `owner_ms` covers the write's way there.
            self._written[endpoint] = now
            self._write([endpoint])
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew())

    def release(self, endpoint: str) -> None:
        self._held[endpoint] -= 1
        if self._held[endpoint] <= 0:
            del self._held[endpoint]

    async def _renew(self) -> None:
        """Every `renew_s` while any request is held; ends when none is (the next hold starts it
        again)."""
        while self._held:
            await asyncio.sleep(self.renew_s)
            now = time.monotonic()
            due = [e for e in self._held if now - self._written.get(e, 0.0) >= self.renew_s * 0.9]
            for e in due:
                self._written[e] = now
            if due:
                self._write(due)

    def _write(self, endpoints: list[str]) -> None:
        for e in endpoints:
            task = asyncio.ensure_future(self.redis.set(self.keys.owner(e, self.instance), 1,
                                                    px=self.ttl_ms))
            self._writes.add(task)
            task.add_done_callback(self._written_or_logged)

    def _written_or_logged(self, task: asyncio.Future[Any]) -> None:
        self._writes.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, RedisError | OSError):  # the next renewal tries again
            log.warning("could not renew the marker of this process's proxied requests: %s",
                        exc)
        elif exc is not None:
            log.error("could not renew the marker of this process's proxied requests",
                      exc_info=exc)

    async def close(self) -> None:
        for task in [self._renewing, *self._writes]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task


