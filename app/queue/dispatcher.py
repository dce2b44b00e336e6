"""The dispatcher: wakes on markers, claims with one script, runs calls, reaps expired leases.

One process serves every endpoint.  Claims happen one endpoint at a time, but calls run as
independent asyncio tasks, so a slow endpoint only ever holds its own slots; and no endpoint may
hold more than `SHARE` of this process's capacity, so a backlog on one never starves the rest.
A rate-limited endpoint is left alone until the exact moment its limiter names, while the
others carry on (no back-off sleep of the whole loop, unlike the seed).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.endpoints import EndpointConfig
from app.queue.keys import Keys
from app.queue.registry import EndpointRegistry, cancel_all
from app.queue.scripts import Scripts
from app.queue.upstream import Outcome, Request, backoff_s, call
from app.settings import Settings

log = logging.getLogger(__name__)
SHARE = 0.75
CLAIM_FIELDS = 9  # values per claimed task in claim-5.lua's answer
PROMOTE_GRACE_MS = 250


@dataclass
class Claim:
    endpoint: EndpointConfig
    task_id: str
    token: str
    attempts: int
    ttype: str
    request: Request


@dataclass
class Dispatcher:
    redis: Redis
    blocking: Redis  # its own connections: BZPOPMIN holds one for up to a second
    keys: Keys
    scripts: Scripts
    registry: EndpointRegistry
    settings: Settings
    http: httpx.AsyncClient
    inflight: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    leases: dict[str, Claim] = field(default_factory=dict)
    per_endpoint: Counter[str] = field(default_factory=Counter)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _room: asyncio.Event = field(default_factory=asyncio.Event)
    _loops: list[asyncio.Task[None]] = field(default_factory=list)
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def capacity(self) -> int:
        return self.settings.dispatch_concurrency

    def start(self) -> None:
        self._room.set()
        self.registry.mirror.listeners.append(self._on_config_change)
        for loop in (self._wake_loop, self._reap_loop, self._heartbeat_loop):
            self._loops.append(asyncio.create_task(loop(), name=loop.__name__))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop claiming, give in-flight calls `grace_s` to finish, then cancel the rest.

        A cancelled call's lease runs out and the reaper returns the task to its queue.
        """
        self.stopping.set()
        await cancel_all(self._loops)
        if self.inflight:
            await asyncio.wait(list(self.inflight.values()), timeout=grace_s)
        await cancel_all([*self.inflight.values(), *self._background])

    def _on_config_change(self, changed: set[str]) -> None:
        """A new limit or cap may admit at once: give changed endpoints a claim attempt."""
        if changed and not self.stopping.is_set():
            self._spawn(self._wake(changed))

    async def _wake(self, endpoint_ids: set[str]) -> None:
        try:
            await self.redis.zadd(self.keys.wake, dict.fromkeys(endpoint_ids, 0))
        except RedisError as exc:
            log.warning("could not wake endpoints: %s", exc)

    # -- claiming ---------------------------------------------------------------------------

    async def _wake_loop(self) -> None:
        failures = 0
        while True:
            await self._room.wait()
            try:
                item = await self.blocking.bzpopmin(self.keys.wake, timeout=1)
                failures = 0
            except (RedisError, OSError) as exc:
                failures += 1
                await self._backoff("wake", exc, failures)
                continue
            if item is not None:
                await self.claim(str(item[1]))

    async def claim(self, endpoint_id: str) -> None:
        """Claim what this endpoint may start now, and start it."""
        endpoint = self.registry.get(endpoint_id)
        if endpoint is None or not endpoint.enabled or self.stopping.is_set():
            return  # re-enabling it wakes it again (_on_config_change)
        room = min(self.capacity - len(self.inflight),
                   int(self.capacity * SHARE) - self.per_endpoint[endpoint_id])
        if room <= 0:
            return  # this endpoint's own acks re-add its marker as slots free
        k, e = self.keys, endpoint_id
        try:
            res = await self.scripts.claim(
                keys=[k.queue(e), k.active(e), k.ratelimit(e, endpoint.limiter), k.wake,
                      k.delayed],
                args=[e, room, endpoint.max_concurrency, self.settings.lease_ms,
                      endpoint.limiter, endpoint.rate, endpoint.interval_ms, k.task_prefix(e),
                      secrets.token_hex(8), endpoint.permit_ttl_s * 1000],
            )
        except (RedisError, OSError) as exc:
            log.warning("claim failed", extra={"endpoint": e, "error": str(exc)})
            return
        state, wait_ms = res[0], int(res[1])
        for i in range(3, len(res), CLAIM_FIELDS):
            tid, token, attempts, ttype, *req = res[i:i + CLAIM_FIELDS]
            if ttype == "offline":
                self._start(Claim(endpoint, tid, token, int(attempts), ttype, Request(*req)))
        if state == "limited":
            asyncio.get_running_loop().call_later(wait_ms / 1000, self._retry_claim, e)

    def _retry_claim(self, endpoint_id: str) -> None:
        if not self.stopping.is_set():
            self._spawn(self.claim(endpoint_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a short job, holding a reference so it is not collected half-way."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _start(self, claim: Claim) -> None:
        tid = claim.task_id
        self.leases[tid] = claim
        self.per_endpoint[claim.endpoint.id] += 1
        self.inflight[tid] = asyncio.create_task(self._run(claim), name=tid)
        if len(self.inflight) >= self.capacity:
            self._room.clear()

    def _done(self, claim: Claim) -> None:
        self.inflight.pop(claim.task_id, None)
        self.leases.pop(claim.task_id, None)
        self.per_endpoint[claim.endpoint.id] -= 1
        self._room.set()

    # -- executing --------------------------------------------------------------------------

    async def _run(self, claim: Claim) -> None:
        ep, tid = claim.endpoint, claim.task_id
        extra = {"task_id": tid, "endpoint": ep.id}
        try:
            while True:
                started = time.monotonic()
                outcome = await call(self.http, tid, claim.request, ep.timeout_ms / 1000)
                exec_ms = (time.monotonic() - started) * 1000
                if outcome.ok or not outcome.retryable or claim.attempts > ep.max_retries:
                    await self._finish(claim, outcome, exec_ms)
                    return
                delay = backoff_s(ep.retry_backoff_ms, claim.attempts, outcome.retry_after_s)
                log.info("retrying in %.2f s: %s", delay, outcome.status_code or outcome.text,
                         extra=extra)
                await asyncio.sleep(delay)
                attempts = await self._extend(claim, add_attempt=1)
                if attempts < 0:
                    log.warning("lease lost while backing off", extra=extra)
                    return
                claim.attempts = attempts
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("executor error", extra=extra)
        finally:
            self._done(claim)

    async def _finish(self, claim: Claim, outcome: Outcome, exec_ms: float) -> None:
        k, e = self.keys, claim.endpoint.id
        status = "completed" if outcome.ok else "failed"
        for failures in range(1, 6):
            try:
                acked = await self.scripts.ack(
                    keys=[k.active(e), k.task(claim.task_id), k.queue(e), k.wake, k.stats(e)],
                    args=[claim.task_id, claim.token, status, outcome.text,
                          outcome.status_code or "", self.settings.done_ttl_s * 1000, e,
                          round(exec_ms) if outcome.ok else -1],
                )
                break
            except (RedisError, OSError) as exc:
                await self._backoff("ack", exc, failures)
        else:
            return  # the lease runs out and the reaper re-queues the task
        extra = {"task_id": claim.task_id, "endpoint": e, "status": status,
                 "code": outcome.status_code, "attempts": claim.attempts}
        if acked:
            log.debug("task %s", status, extra=extra)
        else:
            log.warning("lease lost before ack; the newer attempt wins", extra=extra)

    async def _extend(self, claim: Claim, add_attempt: int = 0) -> int:
        k, e = self.keys, claim.endpoint.id
        res = await self.scripts.extend(
            keys=[k.active(e), k.task(claim.task_id)],
            args=[claim.task_id, claim.token, self.settings.lease_ms, add_attempt],
        )
        return int(res)

    async def _heartbeat_loop(self) -> None:
        """Renew every lease this process holds, in one pipeline, every third of a lease."""
        while True:
            await asyncio.sleep(self.settings.lease_ms / 3000)
            claims = list(self.leases.values())
            if not claims:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for c in claims:
                        k, e = self.keys, c.endpoint.id
                        await self.scripts.extend(
                            keys=[k.active(e), k.task(c.task_id)],
                            args=[c.task_id, c.token, self.settings.lease_ms, 0], client=pipe,
                        )
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- reaping ----------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_ms / 1000)
            try:
                await self.reap()
            except (RedisError, OSError) as exc:
                log.warning("reap failed: %s", exc)

    async def reap(self) -> None:
        """Return expired claims of every endpoint, and wake limited endpoints nobody retried."""
        k = self.keys
        endpoints = self.registry.all()
        async with self.redis.pipeline(transaction=False) as pipe:
            for ep in endpoints:
                await self.scripts.reap(
                    keys=[k.active(ep.id), k.queue(ep.id), k.wake, k.stats(ep.id)],
                    args=[ep.id, k.task_prefix(ep.id), ep.max_retries + 1,
                          self.settings.done_ttl_s * 1000, 1000],
                    client=pipe,
                )
            await self.scripts.promote(keys=[k.delayed, k.wake], args=[PROMOTE_GRACE_MS],
                                       client=pipe)
            results = await pipe.execute()
        for ep, (requeued, failed, ended) in zip(endpoints, results, strict=False):
            if requeued or failed or ended:
                log.info("reaped expired leases", extra={
                    "endpoint": ep.id, "requeued": requeued, "failed": failed, "ended": ended})

    async def _backoff(self, what: str, exc: Exception, failures: int) -> None:
        """Redis errors only: 1 s doubling, capped at 5 tries' worth (as the seed did)."""
        delay = min(2 ** min(failures - 1, 4), 16)
        log.warning("%s: redis error (%s); retrying in %d s", what, exc, delay)
        await asyncio.sleep(delay)
