"""Acks that finish in one event-loop turn go to Redis in one pipeline, with the next claims.

Per task the dispatcher used to make three round trips: the ack (which re-added the endpoint's
wake marker when work remained), the wake loop's BZPOPMIN of that marker, and the claim. Here
the acks of a turn go as one script call per endpoint (lua/ack-7.lua: its stats written once
for all of them, not once a task), and an endpoint known to have a backlog gets its claim
(claim-12.lua, for the slots these acks free) queued right behind its acks, in the same write:
as BullMQ's moveToFinished fetches the next job, one round trip finishes a batch and starts the
next.

The claim runs only while this process has room (its wake loop is not waiting for a slot), or
when it is full with the quick calls of this endpoint alone, so another endpoint's marker never
waits behind a busy one: then the ack adds the marker as before and the wake loop takes the
endpoints in marker order. (Full with one endpoint, the wake loop still runs each time the acks
free its slots, before the claim behind them takes them again: it meets another endpoint's
marker then, finds no room, and that endpoint, starved, ends the first one being alone.)

An endpoint whose last ack or claim saw an empty queue is not claimed for (a claim of nothing
would cost its script), nor one whose limiter holds it (its timer claims it at the exact
moment), nor one whose cap in Redis bound the last claim: its freed slots go by marker to
whichever dispatcher pops it first, as before, or the dispatcher holding them would keep them
all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, RedisError

from app.core.loop import persist
from app.core.scripts import Lua
from app.endpoints import EndpointConfig
from app.queue.claims import (
    Claim,
    ack_cost_keys,
    pause_left_ms,
    pause_ms,
    real_cost,
    settle_limits,
)
from app.queue.upstream import Outcome

if TYPE_CHECKING:
    from app.queue.dispatcher import Dispatcher

log = logging.getLogger(__name__)
CLAIMS_FOLLOW = "claims"  # ack-7.lua's ARGV[2]: the claim behind it re-adds the marker
CLAIM_RETRY_S = 1.0
ACK_KEYS = ("active", "queue", "wake", "stats", "outbox", "hooks", "probe")
GROUP_BYTES = 1 << 20  # results in one ack call, about (one larger result goes alone)


@dataclass
class _Ack:
    claim: Claim
    values: list[Any]  # its nine values of ack-7.lua's ARGV
    result: asyncio.Future[int]
    remaining: tuple[int, float] | None = None  # what the upstream said remains (budget-2.lua)
    answered: float = field(default_factory=time.monotonic)

    def current(self) -> list[Any]:
        """Its values as sent now: a pause the answer asked for counts from the answer, not
        from this try (one after a Redis outage would pause the endpoint that much longer)."""
        if not self.values[6]:
            return self.values
        return [*self.values[:6], pause_left_ms(self.values[6], self.answered),
                *self.values[7:]]


@dataclass
class AckBatch:
    disp: Dispatcher
    backlog: dict[str, bool] = field(default_factory=dict)  # endpoint: last seen work waiting
    _pending: list[_Ack] = field(default_factory=list)

    async def ack(self, claim: Claim, outcome: Outcome, exec_ms: float) -> int:
        """Finish this claim (ack-7.lua) with the others of this turn: 1, or 0 when its lease
        was lost."""
        loop = asyncio.get_running_loop()
        cost = real_cost(claim, outcome)
        item = _Ack(claim, [
            claim.task_id, claim.token, "completed" if outcome.ok else "failed", outcome.text,
            outcome.status_code or "", round(exec_ms), pause_ms(claim, outcome),
            "" if cost is None else cost, outcome.meta.dumps() if outcome.meta else ""],
            loop.create_future(), outcome.remaining)
        self._pending.append(item)
        if len(self._pending) == 1:
            loop.call_soon(self.disp._spawn, self._flush())
        return await item.result

    def _call(self, acks: list[_Ack], follow: bool) -> tuple[list[str], list[Any]]:
        """ack-7.lua's KEYS and ARGV for acks of one endpoint that settle the same limits."""
        d, ep = self.disp, acks[0].claim.endpoint
        k, e = d.keys, ep.id
        limit_keys, limits = settle_limits(ep, k, d.settings.rate_guard_ms)
        return [*k.of(e, *ACK_KEYS), *limit_keys, *ack_cost_keys(ep, k, limit_keys),
                *(k.task(a.claim.task_id) for a in acks)], [
            e, CLAIMS_FOLLOW if follow else "", len(acks), *limits,
            *(v for a in acks for v in a.current())]

    def _groups(self, batch: list[_Ack]) -> list[list[_Ack]]:
        """The batch by endpoint: one call each (a changed config's claims apart, should
        their limits differ), and a call carries results of at most about GROUP_BYTES: many
        large results in one command would sit in this process twice and hold Redis for
        the whole of it (and past Redis's query buffer limit, never go through)."""
        groups: dict[tuple[str, int], list[_Ack]] = {}
        out: list[list[_Ack]] = []
        size: dict[tuple[str, int], int] = {}
        for a in batch:
            key = (a.claim.endpoint.id, id(a.claim.endpoint))
            group, n = groups.get(key), len(a.values[3])
            if group is None or size[key] + n > GROUP_BYTES:
                group = groups[key] = []
                out.append(group)
                size[key] = 0
            group.append(a)
            size[key] += n
        return out

    def _claims(self, batch: list[_Ack]) -> dict[str, tuple[EndpointConfig, int, int]]:
        """The endpoints worth a claim behind these acks, for how many slots, and how many of
        those are free now, held until the claim's answer is in (the rest are the acked
        tasks', theirs until their acks answer)."""
        d = self.disp
        if d.stopping.is_set():
            return {}
        full = not d._room.is_set()
        freed = Counter(a.claim.endpoint.id for a in batch)
        out = {}
        for e, n in freed.items():
            ep = d.registry.get(e)
            if (self.backlog.get(e) and ep is not None and ep.enabled and not ep.paused
                    and e not in d._retries and (not full or d.may_take_all(e))):
                free = d._room_for(e)
                if free + n > 0:
                    out[e] = (ep, free + n, max(free, 0))
                    # Held at once: the next endpoint's free room is what this one left.
                    d.reserve(e, max(free, 0))
        return out

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        d = self.disp
        claims = self._claims(batch)
        for e in claims:  # the claim here serves them: no second one when a slot frees
            d._starved.discard(e)
        try:
            await self._send(batch, claims)
        finally:
            for e, (_, _, free) in claims.items():
                d.unreserve(e, free)

    async def _send(self, batch: list[_Ack], claims: dict[str, tuple[EndpointConfig, int, int]]
                    ) -> None:
        """The acks and the claims behind them in one write; each answer applied."""
        d = self.disp
        groups = self._groups(batch)
        acks = [self._call(g, g[0].claim.endpoint.id in claims) for g in groups]
        calls = {e: d.claim_call(ep, room) for e, (ep, room, _) in claims.items()}
        budgets = self._budgets(batch)
        asked = asyncio.get_running_loop().time()
        try:
            res = await Lua.together(d.redis, [
                *((d.scripts.ack, keys, args) for keys, args in acks),
                *((d.scripts.budget, keys, args) for keys, args in budgets),
                *((d.scripts.claim, keys, args) for keys, args in calls.values())])
        except (RedisError, OSError) as exc:
            log.warning("ack batch failed: %s", exc)
            res = [exc] * (len(groups) + len(budgets) + len(calls))
        if any(isinstance(r, NoScriptError) for r in res):  # Redis restarted or flushed
            await self._load()
        for group, r in zip(groups, res, strict=False):
            if isinstance(r, Exception):
                d._spawn(self._one(group))  # on its own: the marker is its to add
            else:
                self._acked(group, r)
        for (keys, args), r in zip(budgets, res[len(groups):], strict=False):
            if isinstance(r, Exception):  # on its own (the script loaded, or Redis back)
                d._spawn(self._budget(keys, args))
        claimed = res[len(groups) + len(budgets):]
        for (e, (ep, _, _)), r in zip(claims.items(), claimed, strict=True):
            if isinstance(r, Exception):
                log.warning("claim failed: %s", r, extra={"endpoint": e})
                d._claim_later(e, 0 if isinstance(r, NoScriptError) else CLAIM_RETRY_S)
            else:
                d.claimed(ep, r, asked)

    def _budgets(self, batch: list[_Ack]) -> list[tuple[list[str], list[Any]]]:
        """budget-2.lua's calls, after the acks and before the claims: per endpoint, the lowest
        count its upstream told in these answers (the latest news of its window)."""
        told: dict[str, tuple[int, float]] = {}
        for a in batch:
            e = a.claim.endpoint.id
            if a.remaining is not None and a.claim.endpoint.honor_upstream_limits:
                told[e] = min(told.get(e, a.remaining), a.remaining)
        return [(list(self.disp.keys.of(e, "stats", "active")), [n, round(s * 1000)])
                for e, (n, s) in told.items()]

    async def _budget(self, keys: list[str], args: list[Any]) -> None:
        try:
            await self.disp.scripts.budget(keys=keys, args=args)
        except (RedisError, OSError) as exc:  # the next answer tells it again
            log.warning("could not keep the upstream's count: %s", exc)

    def _acked(self, group: list[_Ack], res: list[Any]) -> None:
        if not int(res[0]):  # its queue is empty: nothing to claim behind the next acks
            self.backlog[group[0].claim.endpoint.id] = False
        for a, acked in zip(group, res[1:], strict=True):
            self.disp._done(a.claim)  # its slot is free before the claim behind it starts
            if not a.result.done():
                a.result.set_result(int(acked))

    async def _one(self, group: list[_Ack]) -> None:
        """Acks the batch could not make, alone, retried through an outage."""
        def ack() -> Any:  # built at each try: what is left of a pause counts from now
            keys, args = self._call(group, follow=False)
            return self.disp.scripts.ack(keys=keys, args=args)

        try:
            res = await persist("ack", ack)
        except asyncio.CancelledError:
            for a in group:
                a.result.cancel()  # stopping: its waiter ends with it
            raise
        if res is None:  # given up: the leases run out and the reaper hands them back
            for a in group:
                if not a.result.done():
                    a.result.set_result(0)
        else:
            self._acked(group, res)

    async def _load(self) -> None:
        try:
            await self.disp.scripts.ack.load()
            await self.disp.scripts.claim.load()
            await self.disp.scripts.budget.load()
        except (RedisError, OSError) as exc:
            log.warning("could not load scripts: %s", exc)
