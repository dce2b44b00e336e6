"""Acks that finish in one event-loop turn go to Redis in one pipeline, with the next claims.

Per task the dispatcher used to make three round trips: the ack (which re-added the endpoint's
wake marker when work remained), the wake loop's BZPOPMIN of that marker, and the claim. Here
every ack of a turn shares one pipeline, and an endpoint known to have a backlog gets its claim
(claim-12.lua, for the slots these acks free) queued right behind its acks: as BullMQ's
moveToFinished fetches the next job, one round trip finishes a batch and starts the next.

The claim runs only while this process has room (its wake loop is not waiting for a slot), so
another endpoint's marker never waits behind a busy one: then the ack adds the marker as before
and the wake loop takes the endpoints in marker order. An endpoint whose last ack or claim saw
an empty queue is not claimed for (a claim of nothing would cost its script), nor one whose
limiter holds it (its timer claims it at the exact moment), nor one whose cap in Redis bound
the last claim: its freed slots go by marker to whichever dispatcher pops it first, as before,
or the dispatcher holding them would keep them all.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, RedisError

from app.core.loop import persist
from app.core.scripts import Lua
from app.endpoints import EndpointConfig
from app.queue.claims import Claim

if TYPE_CHECKING:
    from app.queue.dispatcher import Dispatcher

log = logging.getLogger(__name__)
CLAIMS_FOLLOW = "claims"  # ack-8.lua's ARGV[6]: the claim behind it re-adds the marker
CLAIM_RETRY_S = 1.0


@dataclass
class _Ack:
    claim: Claim
    keys: list[str]
    args: list[Any]
    result: asyncio.Future[int]


@dataclass
class AckBatch:
    disp: Dispatcher
    backlog: dict[str, bool] = field(default_factory=dict)  # endpoint: last seen work waiting
    _pending: list[_Ack] = field(default_factory=list)

    async def ack(self, claim: Claim, keys: list[str], args: list[Any]) -> int:
        """ack-8.lua for this claim, sent with the others of this turn; its answer."""
        loop = asyncio.get_running_loop()
        item = _Ack(claim, keys, args, loop.create_future())
        self._pending.append(item)
        if len(self._pending) == 1:
            loop.call_soon(self.disp._spawn, self._flush())
        return await item.result

    def _claims(self, batch: list[_Ack]) -> dict[str, tuple[EndpointConfig, int]]:
        """The endpoints worth a claim behind these acks, and for how many slots."""
        d = self.disp
        if d.stopping.is_set() or not d._room.is_set():
            return {}
        freed = Counter(a.claim.endpoint.id for a in batch)
        out = {}
        for e, n in freed.items():
            ep = d.registry.get(e)
            if (self.backlog.get(e) and ep is not None and ep.enabled and not ep.paused
                    and e not in d._retries):
                room = d._room_for(e) + n
                if room > 0:
                    out[e] = (ep, room)
        return out

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        d = self.disp
        claims = self._claims(batch)
        for e in claims:  # the claim here serves them: no second one when a slot frees
            d._starved.discard(e)
        for a in batch:
            a.args[5] = CLAIMS_FOLLOW if a.claim.endpoint.id in claims else ""
        calls = {e: d.claim_call(ep, room) for e, (ep, room) in claims.items()}
        asked = asyncio.get_running_loop().time()
        try:
            res = await Lua.together(d.redis, [
                *((d.scripts.ack, a.keys, a.args) for a in batch),
                *((d.scripts.claim, keys, args) for keys, args in calls.values())])
        except (RedisError, OSError) as exc:
            log.warning("ack batch failed: %s", exc)
            res = [exc] * (len(batch) + len(calls))
        if any(isinstance(r, NoScriptError) for r in res):  # Redis restarted or flushed
            await self._load()
        for a, r in zip(batch, res, strict=False):
            if isinstance(r, Exception):
                a.args[5] = ""  # on its own: the marker is its to add
                d._spawn(self._one(a))
            else:
                if int(r) != 2:  # its queue is empty: nothing to claim behind the next acks
                    self.backlog[a.claim.endpoint.id] = False
                d._done(a.claim)  # its slot is free before the claim behind it starts
                if not a.result.done():
                    a.result.set_result(int(r))
        for (e, (ep, _)), r in zip(claims.items(), res[len(batch):], strict=True):
            if isinstance(r, Exception):
                log.warning("claim failed: %s", r, extra={"endpoint": e})
                d._claim_later(e, 0 if isinstance(r, NoScriptError) else CLAIM_RETRY_S)
            else:
                d.claimed(ep, r, asked)

    async def _one(self, a: _Ack) -> None:
        """An ack the batch could not make, alone, retried through an outage."""
        d = self.disp
        try:
            acked = await persist("ack", lambda: d.scripts.ack(keys=a.keys, args=a.args))
        except asyncio.CancelledError:
            a.result.cancel()  # stopping: its waiter ends with it
            raise
        if not a.result.done():
            a.result.set_result(int(acked or 0))

    async def _load(self) -> None:
        try:
            await self.disp.scripts.ack.load()
            await self.disp.scripts.claim.load()
        except (RedisError, OSError) as exc:
            log.warning("could not load scripts: %s", exc)
