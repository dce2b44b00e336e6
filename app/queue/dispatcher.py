"""The dispatcher: wakes on markers, claims with one script, runs calls (reaper.py beside it).

One process serves every endpoint.  Claims happen one endpoint at a time, but calls run as
independent asyncio tasks, so a slow endpoint only ever holds its own slots; and no endpoint may
hold more than `SHARE` of this process's capacity, so a backlog on one never starves the rest.
An endpoint alone here whose calls end within LEND_MS may take every slot (a share kept for
nobody was a quarter of the process idle): another one woken meanwhile waits for one of its
calls to end, no longer, and then has its share.
A rate-limited endpoint is left alone until the exact moment its limiter names, while the
others carry on (no back-off sleep of the whole loop, unlike the seed).

Nothing is lost: a task is in a queue or in `active` under a lease until it is acknowledged.
Through a Redis outage every loop retries with a short capped back-off and carries on.  On stop
(SIGTERM) the dispatcher stops claiming, lets calls in flight finish within a grace period while
it keeps renewing their leases, and hands the rest back to their queues at once
(lua/release-8.lua) instead of leaving them to the reaper when their leases run out.

A running call cancelled (cancel-9.lua) is aborted here as soon as its cancel is heard
(app/queue/cancels.py, or the lease renewal's answer): its connection closes, so the upstream
sees it go, and its slot is free for the next task at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app import logs, tracing
from app.core.blocking import HeldPop
from app.core.keys import Keys
from app.core.loop import backoff, persist
from app.core.registry import EndpointRegistry, cancel_all
from app.core.scripts import Scripts
from app.endpoints import EndpointConfig
from app.lifecycle import Ttls
from app.queue import cancels
from app.queue.acks import AckBatch
from app.queue.claims import (
    CLAIM_FIELDS,
    Claim,
    claim_args,
    claim_keys,
    given_back,
    pause_left_ms,
    pause_ms,
    settle_args,
)
from app.queue.fairness import starvation_keys
from app.queue.http1 import UpstreamClient
from app.queue.objects import ObjectStore
from app.queue.reaper import Reaper
from app.queue.upstream import Keeper, Outcome, Request, backoff_s, call
from app.ratelimit.sent import SendTimes
from app.settings import Settings

log = logging.getLogger(__name__)
SHARE = 0.75
# An endpoint alone may have the slots beyond its share while its calls take this long on
# average: the longest another endpoint then waits for a slot (the stall bound of issue 15).
LEND_MS = 50.0
WAKE_BLOCK_S = 1  # BZPOPMIN timeout: how long stopping may wait for the wake loop
CLAIM_RETRY_S = 1.0  # a claim that met a Redis error is tried again after this
HEARTBEAT_RETRY_S = 0.5
RELEASE_WINDOW_S = 5.0  # how long stopping keeps trying to hand tasks back through an outage


@dataclass
class Dispatcher:
    redis: Redis
    blocking: Redis  # its own connections: BZPOPMIN holds one for up to a second
    keys: Keys
    scripts: Scripts
    registry: EndpointRegistry
    settings: Settings
    http: UpstreamClient
    objects: ObjectStore | None = None  # the result store: answers too large to inline
    inflight: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    leases: dict[str, Claim] = field(default_factory=dict)
    per_endpoint: Counter[str] = field(default_factory=Counter)
    # Slots asked for by claims whose answers are still on their way: two claims at once (the
    # wake loop's, one behind acks, a starved endpoint's) must not both count the same free
    # slot, or more calls than slots run at once.
    claiming: Counter[str] = field(default_factory=Counter)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _room: asyncio.Event = field(default_factory=asyncio.Event)
    _drained: asyncio.Event = field(default_factory=asyncio.Event)
    _claimers: list[asyncio.Task[None]] = field(default_factory=list)  # wake loops, reaper
    _heartbeat: list[asyncio.Task[None]] = field(default_factory=list)
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _retries: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    _starved: set[str] = field(default_factory=set)  # woken while this process had no room
    _in_claim: set[str] = field(default_factory=set)  # wake sets whose loop is claiming
    _call_ms: dict[str, float] = field(default_factory=dict)  # moving average per endpoint
    _aborted: set[str] = field(default_factory=set)  # calls cancelled, their tasks ending
    cancels_heard: asyncio.Event = field(default_factory=asyncio.Event)  # subscribed
    _ident: str = field(init=False)
    ident: str = field(init=False)

    def __post_init__(self) -> None:
        self.ttls = Ttls.of(self.settings)
        self.keeper = Keeper(self.objects, self.settings.result_inline_bytes) \
            if self.objects is not None else None
        self.acks = AckBatch(self)
        self.send_times = SendTimes(self.redis, self.keys, self.scripts.sent)
        # Lease tokens name their holder, so an operator can tell who holds a task.
        self._ident = f"{os.getpid()}@{socket.gethostname()}"
        # Its heartbeat's name (app/queue/heartbeats.py): one per dispatcher, even two in one
        # process.
        self.ident = f"{self._ident}#{secrets.token_hex(3)}"

    @property
    def capacity(self) -> int:
        return self.settings.dispatch_concurrency

    def start(self) -> None:
        self._room.set()
        self.registry.mirror.listeners.append(self._on_config_change)
        reaper = Reaper(self.redis, self.keys, self.scripts, self.registry, self.settings)
        # One loop per wake set: one on one Redis, one per endpoint group on a Cluster (a
        # blocking pop may not span slots), so an endpoint on any master wakes it at once.
        for wake, _ in self.keys.wake_sets():
            self._claimers.append(asyncio.create_task(self._wake_loop(wake), name=wake))
        self._claimers.append(asyncio.create_task(reaper.run(), name="reaper"))
        self._heartbeat.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        self._heartbeat.append(asyncio.create_task(cancels.listen(
            self.redis, self.keys.cancels_pattern, self.abort, self.cancels_heard),
            name="cancels"))

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop claiming, give calls in flight `grace_s` to finish, hand the rest back at once.

        Leases are renewed throughout, so nobody else starts a task still running here.
        """
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.stopping.set()
        await self._stop_claiming()
        if self.inflight:
            log.info("stopping: %d calls in flight, %.1f s grace", len(self.inflight), grace)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, deadline - time.monotonic()))
        held = list(self.leases.values())
        await cancel_all([*self.inflight.values(), *self._background])
        released = await self.release(held)
        await self.send_times.close()
        await cancel_all(self._heartbeat)
        log.info("dispatcher stopped", extra={"interrupted": len(held), "requeued": released})

    def hurry(self) -> None:
        """End the grace period now (a second SIGTERM)."""
        self._drained.set()

    async def _stop_claiming(self) -> None:
        """Stop the wake loop and the reaper.  A claim whose reply is on its way is waited for:
        cancelling it would leave its tasks leased to nobody until the lease runs out."""
        for timer in self._retries.values():
            timer.cancel()
        loops = self._claimers[:-1]
        for loop in loops:  # blocked in BZPOPMIN or backing off: nothing to lose but a
            if loop.get_name() not in self._in_claim:  # marker, which the reapers' nudge
                loop.cancel()  # restores
        pending = [*loops, *self._background]
        await asyncio.wait(pending, timeout=WAKE_BLOCK_S + self.settings.redis_timeout_s)
        await cancel_all(self._claimers)

    def _on_config_change(self, changed: set[str]) -> None:
        """A new limit or cap may admit at once: give changed endpoints a claim attempt."""
        if changed and not self.stopping.is_set():
            self._spawn(self._wake(changed))

    async def _wake(self, endpoint_ids: set[str]) -> None:
        by_set: dict[str, list[str]] = {}
        for e in endpoint_ids:
            by_set.setdefault(self.keys.wake(e), []).append(e)
        try:
            for wake, ids in by_set.items():
                await self.redis.zadd(wake, dict.fromkeys(ids, 0))
        except RedisError as exc:
            log.warning("could not wake endpoints: %s", exc)

    # -- claiming ---------------------------------------------------------------------------

    async def _wake_loop(self, wake: str) -> None:
        pops = HeldPop(self.blocking)
        try:
            await self._wake_on(wake, pops)
        finally:
            await pops.close()

    async def _wake_on(self, wake: str, pops: HeldPop) -> None:
        failures = 0
        while not self.stopping.is_set():
            await self._room.wait()
            try:
                item = await pops.bzpopmin(wake, WAKE_BLOCK_S)
            except (RedisError, OSError) as exc:
                failures += 1
                await backoff("wake", exc, failures)
                continue
            if failures:
                log.info("redis reachable again after %d failed tries", failures)
                failures = 0
            if item is None:
                continue
            self._in_claim.add(wake)
            try:
                await self.claim(str(item[1]))
            finally:
                self._in_claim.discard(wake)

    async def claim(self, endpoint_id: str) -> None:
        """Claim what this endpoint may start now, and start it."""
        endpoint = self.registry.get(endpoint_id)
        if endpoint is None or not endpoint.enabled or endpoint.paused or self.stopping.is_set():
            return  # re-enabling (resuming) it wakes it again (_on_config_change)
        room = self._room_for(endpoint_id)
        if room <= 0:
            # Its wake marker is spent, and the ack that re-added it may have landed before
            # its slot freed here: claim again when one frees (_done), not at the next nudge.
            self._starved.add(endpoint_id)
            return
        keys, args = self.claim_call(endpoint, room)
        # Asked for now: the admissions happen after this, however late the answer is read.
        asked = asyncio.get_running_loop().time()
        self.reserve(endpoint_id, room)
        try:
            res = await self.scripts.claim(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            # Its wake marker is spent: try again rather than wait for somebody to re-add it.
            log.warning("claim failed: %s", exc, extra={"endpoint": endpoint_id})
            self._claim_later(endpoint_id, CLAIM_RETRY_S)
            return
        else:
            self.claimed(endpoint, res, asked)
        finally:
            self.unreserve(endpoint_id, room)

    def reserve(self, endpoint_id: str, slots: int) -> None:
        """Hold `slots` for a claim on its way (its answer starts what it got)."""
        self.claiming[endpoint_id] += slots

    def unreserve(self, endpoint_id: str, slots: int) -> None:
        """The claim's answer is in (its tasks started): what it did not use is free again."""
        self.claiming[endpoint_id] -= slots
        if not self.claiming[endpoint_id]:
            del self.claiming[endpoint_id]
        self._wake_starved()

    def claim_call(self, endpoint: EndpointConfig, room: int) -> tuple[list[str], list[Any]]:
        """claim-12.lua's KEYS and ARGV for up to `room` tasks of this endpoint."""
        return claim_keys(self.keys, endpoint), claim_args(
            self.keys, endpoint, room, f"{self._ident}.{secrets.token_hex(8)}",
            self.settings.lease_ms, self.settings.rate_guard_ms)

    def claimed(self, endpoint: EndpointConfig, res: list[Any], asked: float) -> None:
        """Start what a claim-12.lua answer holds."""
        state, wait_ms = res[0], int(res[1])
        # Only a claim this process's share cut short is followed by claims behind its acks:
        # slots an endpoint's cap frees go by marker to whichever dispatcher pops it first, or
        # the one that holds them would keep them all (app/queue/acks.py).
        self.acks.backlog[endpoint.id] = state == "more"
        for i in range(3, len(res), CLAIM_FIELDS):
            tid, token, attempts, ttype, method, url, headers, query, body, cost = \
                res[i:i + CLAIM_FIELDS]
            if ttype == "offline":
                # The call goes where the endpoint points now, not to the caller's URL string.
                req = Request(method, endpoint.call_url(url), headers, query, body,
                              endpoint.forwarded, endpoint.cost_from if endpoint.max_cost
                              else None, endpoint.credentials)
                self._start(Claim(endpoint, tid, token, int(attempts), ttype, req, asked,
                                  int(cost)))
        if state == "limited":
            self._claim_later(endpoint.id, wait_ms / 1000)

    def _room_for(self, endpoint_id: str) -> int:
        share = self.capacity
        if not self.may_take_all(endpoint_id):
            # At least one slot: a process of one slot has a share of 0.75, which claimed
            # nothing.
            share = max(1, int(self.capacity * SHARE))
        return min(self.capacity - len(self.inflight) - self.claiming.total(),
                   share - self.per_endpoint[endpoint_id] - self.claiming[endpoint_id])

    def may_take_all(self, endpoint_id: str) -> bool:
        """Whether this endpoint may have every slot: only its calls are in flight here, its
        calls end within LEND_MS (measured here), and no other endpoint was woken while the
        process had no room for it (another's marker met while full shows as starved)."""
        return (len(self.inflight) == self.per_endpoint[endpoint_id]
                and self._call_ms.get(endpoint_id, math.inf) <= LEND_MS
                and self._starved <= {endpoint_id})

    def _claim_later(self, endpoint_id: str, delay_s: float) -> None:
        """Claim again after `delay_s`, keeping one timer per endpoint: every ack of a limited
        endpoint wakes it, and if each limited claim added a timer of its own, the timers (and
        the claims) would multiply until they took the whole event loop."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        pending = self._retries.get(endpoint_id)
        if pending is not None:
            if pending.when() <= when:
                return
            pending.cancel()
        self._retries[endpoint_id] = loop.call_at(when, self._retry_claim, endpoint_id)

    def _retry_claim(self, endpoint_id: str) -> None:
        self._retries.pop(endpoint_id, None)
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
        """Free its slot; once only (an ack batch frees its slots before starting the next)."""
        if self.leases.pop(claim.task_id, None) is None:
            return
        self.inflight.pop(claim.task_id, None)
        self.per_endpoint[claim.endpoint.id] -= 1
        self._room.set()
        if self.stopping.is_set():
            if not self.inflight:
                self._drained.set()
            return
        self._wake_starved()

    def _wake_starved(self) -> None:
        """Claim for the endpoints met while this process had no room, now that it has."""
        if self.stopping.is_set():
            return
        for endpoint_id in [e for e in self._starved if self._room_for(e) > 0]:
            self._starved.discard(endpoint_id)
            self._spawn(self.claim(endpoint_id))

    # -- executing --------------------------------------------------------------------------

    def abort(self, task_id: str) -> None:
        """Its task was cancelled while its call runs here: abort the call (the connection
        closes); the slot frees as its run ends. Not ours, or ending already: nothing."""
        running = self.inflight.get(task_id)
        if running is None or task_id in self._aborted:
            return
        self._aborted.add(task_id)
        running.cancel()

    async def _run(self, claim: Claim) -> None:
        """One attempt: a retry is set aside in Redis and claimed again, never slept on here."""
        ep, tid = claim.endpoint, claim.task_id
        outcome: Outcome | None = None
        try:
            if claim.attempts > ep.max_retries + 1:  # max_retries lowered since queued
                await self._finish(claim, Outcome(None, "no attempts left"), -1)
                return
            traced = (tracing.TaskTrace(tid, ep.id, claim.request.headers, claim.attempts)
                      if tracing.ENABLED else None)
            started = time.monotonic()
            outcome = await self._call(claim, traced)
            exec_ms = (time.monotonic() - started) * 1000
            if outcome.measured:
                average = self._call_ms.get(ep.id, exec_ms)
                self._call_ms[ep.id] = average + (exec_ms - average) / 8
            else:  # -1: no call made, for the scripts (a failure that tells nothing of the
                # upstream must not read as its refusal and halve an adaptive cap)
                exec_ms = -1
            # A refusal given back goes back in line, its attempt not spent (claims.given_back).
            final = not given_back(claim, outcome) and (
                outcome.ok or not outcome.retryable or claim.attempts > ep.max_retries)
            end = (self._finish(claim, outcome, exec_ms) if final
                   else self._retry_later(claim, outcome, exec_ms))
            if traced is None:
                await end
            else:
                with traced.ack("ack" if final else "retry"):
                    await end
        except asyncio.CancelledError:
            if tid not in self._aborted:
                raise
            # The cancel script ended the task and took its lease: nothing left to write,
            # and an answer stored already (any ack of it is refused) is nobody's.
            log.info("call aborted: its task was cancelled", extra={"task_id": tid,
                                                                    "endpoint": ep.id})
            await self._drop_answer(outcome)
        except Exception:
            log.exception("executor error", extra={"task_id": tid, "endpoint": ep.id})
        finally:
            self._aborted.discard(tid)
            self._done(claim)

    async def _call(self, claim: Claim, traced: tracing.TaskTrace | None) -> Outcome:
        """The upstream call; traced, in a `call` span whose context the upstream gets."""
        args = (claim.endpoint.timeout_ms / 1000, self.settings.max_result_bytes,
                claim.on_sent(self.send_times), self.keeper)
        if traced is None:
            return await call(self.http, claim.task_id, claim.request, *args)
        req = claim.request
        with traced.call(req.method, req.url) as (span, headers):
            req = replace(req, headers=tracing.with_headers(req.headers, headers))
            outcome = await call(self.http, claim.task_id, req, *args)
            traced.answered(span, outcome.status_code, outcome.text)
        return outcome

    async def _retry_later(self, claim: Claim, outcome: Outcome, exec_ms: float) -> None:
        """Set the task aside in Redis for its back-off (retry-8.lua): its slot serves others
        meanwhile, and a claim puts it back in line when due (a new admission, as any)."""
        ep, k, e = claim.endpoint, self.keys, claim.endpoint.id
        delay = backoff_s(ep.retry_backoff_ms, claim.attempts, outcome.retry_after_s)
        extra = {"task_id": claim.task_id, "endpoint": e}
        log.info("retrying in %.2f s: %s", delay, outcome.status_code or outcome.text,
                 extra=extra)
        limit_keys, settle = settle_args(claim, outcome, k, self.settings.rate_guard_ms)
        pause, answered = pause_ms(claim, outcome), time.monotonic()
        due = await persist("retry", lambda: self.scripts.retry(
            keys=[k.active(e), k.task(claim.task_id),
                  *k.of(e, "retry", "delayed", "queue", "wake", "stats", "probe"), *limit_keys,
                  *k.of(e, *starvation_keys(ep))],
            args=[claim.task_id, claim.token, round(delay * 1000), e,
                  pause_left_ms(pause, answered), outcome.status_code or "", round(exec_ms),
                  *settle]))
        if not due:
            log.warning("lease lost before the retry was scheduled", extra=extra)
        elif due != 1 and not self.stopping.is_set():  # 1: back in line, its marker set
            self._claim_later(e, delay)

    async def _finish(self, claim: Claim, outcome: Outcome, exec_ms: float) -> None:
        e = claim.endpoint.id
        status = "completed" if outcome.ok else "failed"
        acked = await self.acks.ack(claim, outcome, exec_ms)
        extra = {"task_id": claim.task_id, "endpoint": e, "status": status,
                 "code": outcome.status_code, "attempts": claim.attempts}
        if acked and outcome.ok:
            log.debug("task %s", status, extra=extra)
        elif acked:  # for good: an operator wants to see these without debug on
            log.warning("task failed: %s", logs.clipped(outcome.text, 200), extra=extra)
        else:
            log.warning("lease lost before ack; the newer attempt wins", extra=extra)
            await self._drop_answer(outcome)

    async def _drop_answer(self, outcome: Outcome | None) -> None:
        """An answer in the result store whose task ended otherwise (cancelled, its lease
        lost): no task refers to its object, which goes now rather than at the sweep. Only
        such answers reach the store: every other ending costs no call to it."""
        ref = outcome.meta.ref if outcome is not None and outcome.meta is not None else None
        if ref and self.objects is not None:
            await self.objects.drop([ref])

    async def release(self, claims: list[Claim]) -> int:
        """Hand claims back to their queues now; returns how many were re-queued."""
        if not claims:
            return 0
        k = self.keys

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for c in claims:
                    e = c.endpoint.id
                    await self.scripts.release(
                        keys=[k.active(e), k.task(c.task_id),
                              *k.of(e, "queue", "wake", "stats", "outbox", "hooks", "probe",
                                    *starvation_keys(c.endpoint))],
                        args=[c.task_id, c.token, e, c.endpoint.max_retries + 1,
                              self.ttls.done_ms], client=pipe)
                return await pipe.execute()

        results = await persist("release", run, RELEASE_WINDOW_S)
        if results is None:
            log.warning("could not hand %d tasks back; their leases will run out", len(claims))
            return 0
        for c, r in zip(claims, results, strict=True):
            if int(r):
                log.info("failed: its last attempt was interrupted" if int(r) == 2 else
                         "handed back to its queue", extra={"task_id": c.task_id,
                         "endpoint": c.endpoint.id, "attempts": c.attempts})
        return sum(1 for r in results if int(r) == 1)

    async def _heartbeat_loop(self) -> None:
        """Renew every lease this process holds, in one pipeline, every third of a lease;
        sooner after a failure, so a short Redis outage costs no lease."""
        delay = period = self.settings.lease_ms / 3000
        while True:
            await asyncio.sleep(delay)
            claims = list(self.leases.values())
            if not claims:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for c in claims:
                        k, e = self.keys, c.endpoint.id
                        await self.scripts.extend(
                            keys=[k.active(e), k.task(c.task_id), k.probe(e)],
                            args=[c.task_id, c.token, self.settings.lease_ms], client=pipe,
                        )
                    renewed = await pipe.execute()
                delay = period
                for c, r in zip(claims, renewed, strict=True):
                    if int(r) == -2:  # cancelled, and its message not heard (cancels.py)
                        self.abort(c.task_id)
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
                delay = min(period, HEARTBEAT_RETRY_S)
