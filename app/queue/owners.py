"""Which API processes still hold the callers of their proxied requests.

A proxied request waits in line as a task while one API process holds its caller's connection.
When that process dies (kill -9, an OOM kill, its node lost), nobody is left to make the call;
yet a dispatcher's claim would admit the task, and its slot would stay taken until its lease
lapsed: a whole lease for each orphan, an endpoint shut for minutes behind a crashed pod's
waiting requests.

So each API process keeps one marker per endpoint while it holds proxied requests there
(`Keys.owner`: a key with a TTL on the Redis clock, QGW_PROXY_OWNER_TTL_MS but at most its lease,
written again every fifth of it), and each such task names its marker and that TTL (fields
`owner`, `owner_ms`). A claim (lua/claim-12.lua) then:
- finding the marker of a task at the head of the line gone (the task older than `owner_ms`:
  a new marker's first write may still be on its way), writes down when it saw that (in the
  marker: `gone:<ms>`) and holds the line for two fifths of `owner_ms`, 2 s at least (the
  settle): time for a live process to write its marker again, after a Redis outage longer than
  the TTL or a stall. Still gone
  then, the task ends `failed` ("caller connection lost") without being admitted, and so does
  every other task naming that marker as the line reaches it, without holding it again;
- gives a proxy task it admits for another process a lease of `owner_ms` only (a pickup lease),
  which its process renews to a whole lease a third of the way in (app/proxy/relay.py): one
  admitted just before its process died frees its slot that soon, not a whole lease later.

A process stalled for longer than the TTL and the settle loses its waiting requests (`failed`),
as one stalled past its lease loses its calls. Costs: a `SET` per endpoint every fifth of the
TTL while requests wait there; nothing in a request's own path.
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
#: How soon a marker whose write failed (Redis away) is written again: well within the settle a
#: claim gives it once Redis is back.
RETRY_S = 0.25


class Owners:
    def __init__(self, redis: Redis, keys: Keys, ident: str, ttl_ms: int) -> None:
        self.redis, self.keys, self.ttl_ms = redis, keys, ttl_ms
        self.renew_s = ttl_ms / 5000
        # Not the process ident alone: a process restarted under the same pid and hostname (a
        # container's) must not pass for the one whose requests it never held.
        self.instance = f"{ident}.{os.urandom(4).hex()}"
        self._held: Counter[str] = Counter()
        self._written: dict[str, float] = {}  # monotonic: each marker's last write that landed
        self._writing: dict[str, asyncio.Future[Any]] = {}  # kept from the GC till they land
        self._failed: set[str] = set()  # endpoints whose last write failed: again after RETRY_S
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False

    def marker(self, endpoint: str) -> tuple[str, int]:
        """The marker a proxied request's task names, and its TTL (ms): its fields `owner` and
        `owner_ms`."""
        return self.keys.owner(endpoint, self.instance), self.ttl_ms

    def hold(self, endpoint: str) -> None:
        """A proxied request of `endpoint` is in this process from now: its marker is kept."""
        self._held[endpoint] += 1
        if self._due(endpoint, time.monotonic(), self.renew_s):
            self._write(endpoint)  # not awaited: the task's `owner_ms` covers its way there
        if (self._renewing is None or self._renewing.done()) and not self._closed:
            self._renewing = asyncio.create_task(self._renew())

    def release(self, endpoint: str) -> None:
        self._held[endpoint] -= 1
        if self._held[endpoint] <= 0:
            del self._held[endpoint]
            self._failed.discard(endpoint)

    def _due(self, endpoint: str, now: float, age_s: float) -> bool:
        last = self._written.get(endpoint)
        return endpoint not in self._writing and (last is None or now - last >= age_s)

    async def _renew(self) -> None:
        """While any request is held; it ends when none is (the next hold starts it again)."""
        while self._held:
            await asyncio.sleep(RETRY_S if self._failed else self.renew_s)
            now = time.monotonic()
            for e in list(self._held):
                if self._due(e, now, 0.0 if e in self._failed else self.renew_s * 0.9):
                    self._write(e)

    def _write(self, endpoint: str) -> None:
        write = asyncio.ensure_future(self.redis.set(
            self.keys.owner(endpoint, self.instance), 1, px=self.ttl_ms))
        self._writing[endpoint] = write
        started = time.monotonic()

        def landed(_: asyncio.Future[Any]) -> None:
            del self._writing[endpoint]
            if write.cancelled():
                return
            exc = write.exception()
            if exc is None:
                self._written[endpoint] = started
                self._failed.discard(endpoint)
                return
            self._failed.add(endpoint)
            if isinstance(exc, RedisError | OSError):  # written again after RETRY_S
                log.warning("could not renew the marker of this process's proxied requests: "
                            "%s", exc)
            else:
                log.error("could not renew the marker of this process's proxied requests",
                          exc_info=exc)

        write.add_done_callback(landed)

    async def close(self) -> None:
        self._closed = True
        for task in [self._renewing, *self._writing.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task
