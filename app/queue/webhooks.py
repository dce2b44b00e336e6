"""The webhook sender: POSTs a finished task's status to its `callback_url` (docs/api.md).

Pending deliveries live in Redis, never only here: the script that ends a task puts its id in
its endpoint's `hooks` ZSet (lua/includes/lifecycle.lua), and a sender takes due ones with a
lease (hookclaim-1.lua), so a dispatcher killed mid-delivery loses nothing: another one sends
it again once the lease has run out. Delivery is therefore at least once; the
`X-Queue-Delivery` id (task id and when it ended) stays the same over every retry, so a
receiver de-duplicates on it. A failure is retried with exponential back-off and jitter until
a 2xx, and given up (a warning) only once the task ended more than GIVE_UP_S ago.

The body is the status JSON the owner would read, rendered from the task hash itself: the
task stays in Redis while its webhook is due (saved-1.lua, status-6.lua set no TTL then) and
gets its done TTL once it is delivered or given up (hookdone-3.lua)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from starlette.responses import JSONResponse

from app.core.keys import Keys, endpoint_of
from app.core.loop import STORE_ERRORS, every
from app.core.registry import EndpointRegistry, Mirror, cancel_all
from app.core.scripts import Scripts
from app.lifecycle import Ttls
from app.models import TaskStatus, TaskView
from app.queue.http1 import UpstreamClient
from app.queue.receivers import Receivers, receiver_of
from app.settings import Settings
from app.store import ApiKey
from app.webhooks import allowed, signature

log = logging.getLogger(__name__)
#: How often due deliveries are looked for (one round trip for every endpoint).
INTERVAL_S = 0.25
#: Deliveries one process has in flight at most (over all endpoints).
MAX_IN_FLIGHT = 64
#: Of which one receiver holds at most this many while it answers (app/queue/receivers.py).
RECEIVER_SHARE = MAX_IN_FLIGHT // 8
#: Claims a tick may make back to back while deliveries go back to wait for their receivers.
MAX_ROUNDS = 8
ANSWER_BYTES = 64 * 1024  # a receiver's answer is not kept: only its status counts
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 300.0
#: A webhook is retried for at least this long after its task ended (docs/api.md: an hour).
GIVE_UP_S = 3600.0


def backoff_ms(tries: int) -> int:
    """Exponential (1 s, 2 s, 4 s ... 5 min), jittered by a quarter either way so the
    retries of many deliveries that failed together do not arrive together again."""
    delay = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** min(tries, 20))
    return int(delay * random.uniform(0.75, 1.25) * 1000)


def render(view: TaskView) -> bytes:
    """The status JSON, byte for byte as GET /api/v1/tasks/{id} answers it."""
    return bytes(JSONResponse(view.model_dump(mode="json")).body)


@dataclass
class WebhookSender:
    redis: Redis
    keys: Keys
    scripts: Scripts
    registry: EndpointRegistry
    api_keys: Mirror[ApiKey]
    settings: Settings
    view: Callable[[str, dict[str, str]], TaskView]
    http: UpstreamClient | None = None
    _loop: asyncio.Task[None] | None = None
    _sending: set[asyncio.Task[None]] = field(default_factory=set)
    _by_id: tuple[str | None, dict[str, ApiKey]] = (None, {})
    _turn: int = 0
    receivers: Receivers = field(default_factory=lambda: Receivers(RECEIVER_SHARE))

    @property
    def lease_ms(self) -> int:
        """A delivery's lease: its POST's timeout and a margin (half of it, at least 1 s)."""
        timeout_ms = self.settings.webhook_timeout_s * 1000
        return int(timeout_ms + max(1000, timeout_ms / 2))

    def start(self) -> None:
        # The client of business API calls: no redirects, no cookies; its connections are as
        # many as the deliveries in flight (MAX_IN_FLIGHT).
        self.http = UpstreamClient("queue-gateway-webhook")
        self._loop = asyncio.create_task(every("webhooks", INTERVAL_S, self.tick),
                                         name="webhooks")

    async def stop(self) -> None:
        """Deliveries cut short stay due in Redis: another sender tries them after the lease."""
        await cancel_all([t for t in (self._loop, *self._sending) if t is not None])
        if self.http is not None:
            await self.http.close()

    async def tick(self) -> None:
        """Take due deliveries of every endpoint and start sending them; again at once while
        claims come back full and some went back to wait for their receivers (the ones
        behind them may be for receivers that answer)."""
        for _ in range(MAX_ROUNDS):
            if not await self._round():
                return

    async def _round(self) -> bool:
        """One claim (one round trip for every endpoint); True if worth another at once."""
        free = MAX_IN_FLIGHT - len(self._sending)
        endpoints = [e.id for e in self.registry.all()]
        if free <= 0 or not endpoints:
            return False
        # Never more than `free` in all: with more endpoints than that, a window of them a
        # tick, turning, so each gets its turn.
        self._turn = (self._turn + 1) % len(endpoints)
        endpoints = (endpoints[self._turn:] + endpoints[:self._turn])[:free]
        each = free // len(endpoints)
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in endpoints:
                await self.scripts.hookclaim(keys=[self.keys.hooks(e)],
                                             args=[self.lease_ms, each], client=pipe)
            claimed = await pipe.execute()
        batch = [(int(deadline), tid) for deadline, *ids in claimed for tid in ids]
        if not batch:
            return False
        waiting = await self._start(batch)
        return bool(waiting) and any(len(c) - 1 >= each for c in claimed)

    async def _start(self, batch: list[tuple[int, str]]) -> int:
        """Send each claimed delivery whose receiver has room; put the others back until it
        may (not a try). How many were put back."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, task_id in batch:
                pipe.hmget(self.keys.task(task_id), "callback_url", "hook")
            found = await pipe.execute()
        back = []
        for (deadline, task_id), (url, hook) in zip(batch, found, strict=True):
            name = receiver_of(url) if url and hook else None
            if name is not None and self._ended_s_ago(hook, deadline) < GIVE_UP_S:
                wait_s = self.receivers.admit(name)
                if wait_s:
                    back.append((task_id, hook, deadline, wait_s))
                    continue
            else:
                name = None  # nothing to send, or its last try: not held back
            task = asyncio.create_task(self._deliver(task_id, deadline, name))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        if back:
            async with self.redis.pipeline(transaction=False) as pipe:
                for task_id, hook, deadline, wait_s in back:
                    await self.scripts.hookretry(
                        keys=[self.keys.task(task_id), self.keys.hooks(endpoint_of(task_id))],
                        args=[task_id, hook, deadline, int(wait_s * 1000), "0"], client=pipe)
                await pipe.execute()
        return len(back)

    def _ended_s_ago(self, hook: str, deadline: int) -> float:
        """How long ago its task ended (`hook`), by the Redis clock that stamped it: as read by
        the delivery's claim (its lease's deadline less the lease), not this host's clock,
        which may be off by any amount."""
        return (deadline - self.lease_ms - int(hook)) / 1000

    async def _deliver(self, task_id: str, deadline: int, receiver: str | None) -> None:
        extra = {"task_id": task_id, "endpoint": endpoint_of(task_id)}
        unreachable = False
        try:
            unreachable = await self._try(task_id, deadline, extra)
        except STORE_ERRORS as exc:  # Redis went away: the lease runs out, it is tried again
            log.warning("webhook: %s", exc, extra=extra)
        except Exception:  # a bug must not stay silent; the lease brings the delivery back
            log.exception("webhook failed", extra=extra)
        finally:
            if receiver is not None:
                self.receivers.done(receiver, unreachable)

    async def _try(self, task_id: str, deadline: int, extra: dict[str, Any]) -> bool:
        """Deliver, or put back for a retry; True when the receiver timed out or refused the
        connection (it rests then, Receivers)."""
        fields: dict[str, str] = await self.redis.hgetall(  # type: ignore[assignment]
            self.keys.task(task_id))
        hook, url = fields.get("hook"), fields.get("callback_url")
        if not hook or not url or not TaskStatus(fields.get("status", "pending")).finished:
            # Gone, or running again after an operator's retry: its next end brings a webhook.
            await self._done(task_id, hook or "")
            return False
        key = self._key(fields.get("key_id", ""))
        if key is None or not allowed(url, key.callback_urls):
            log.warning("webhook given up: the key that asked for it was revoked", extra=extra)
            await self._done(task_id, hook, "given_up")
            return False
        outcome, unreachable = await self._post(
            url, f"{task_id}:{hook}", key.webhook_secret, render(self.view(task_id, fields)))
        if outcome is None:
            await self._done(task_id, hook, "delivered")
        elif self._ended_s_ago(hook, deadline) >= GIVE_UP_S:
            log.warning("webhook given up after %d tries: %s", int(fields.get("hook_tries", 0))
                        + 1, outcome, extra=extra)
            await self._done(task_id, hook, "given_up")
        else:
            delay = backoff_ms(int(fields.get("hook_tries", 0)))
            log.info("webhook failed (%s); retry in %.1f s", outcome, delay / 1000, extra=extra)
            e = endpoint_of(task_id)
            async with self.redis.pipeline(transaction=False) as pipe:
                await self.scripts.hookretry(keys=[self.keys.task(task_id), self.keys.hooks(e)],
                                             args=[task_id, hook, deadline, delay], client=pipe)
                self._count(pipe, e, "retried")
                await pipe.execute()
        return unreachable

    async def _post(self, url: str, delivery: str, secret: str, body: bytes
                    ) -> tuple[str | None, bool]:
        """(None once the receiver answered 2xx, else what went wrong; whether it timed out
        or could not be reached)."""
        assert self.http is not None
        headers = [("Content-Type", "application/json"), ("X-Queue-Delivery", delivery),
                   ("X-Queue-Signature", signature(secret, int(time.time()), delivery, body))]
        try:
            # No redirects: a receiver must not send the gateway somewhere else.
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                answer = await self.http.request("POST", url, (), headers, body, ANSWER_BYTES)
        except (TimeoutError, OSError, ValueError) as exc:  # BadAnswer is an OSError
            return f"{type(exc).__name__}: {exc}"[:200], isinstance(exc, (TimeoutError,
                                                                          ConnectionError))
        return None if 200 <= answer.status < 300 else f"HTTP {answer.status}", False

    async def _done(self, task_id: str, hook: str, outcome: str | None = None) -> None:
        """No more deliveries of this one; the outcome counted for /metrics in the same round
        trip (qgw_webhooks_<outcome>_total)."""
        e = endpoint_of(task_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            await self.scripts.hookdone(
                keys=[self.keys.task(task_id), self.keys.hooks(e), self.keys.outbox(e)],
                args=[task_id, hook, Ttls.of(self.settings).done_ms], client=pipe)
            if outcome is not None:
                self._count(pipe, e, outcome)
            await pipe.execute()

    def _count(self, pipe: Any, endpoint: str, outcome: str) -> None:
        # The endpoint's stats hash (app/queue/stats.py HOOK_OUTCOMES): shared by every
        # process, read by every scrape with the rest.
        pipe.hincrby(self.keys.stats(endpoint), f"hooks_{outcome}", 1)

    def _key(self, key_id: str) -> ApiKey | None:
        """The live key of that id (the mirror is keyed by key hash), indexed once a version."""
        version, index = self._by_id
        if version != self.api_keys.version or not index:
            index = {k.id: k for k in self.api_keys.items.values()}
            self._by_id = (self.api_keys.version, index)
        return index.get(key_id)
