"""Sliding windows kept to the times calls really leave, not the times they were admitted.

The claim script admits a call on the Redis clock, but the call leaves the dispatcher a little
later: a moment's lag of a busy event loop, a connection to open (every call at once, when a
burst meets a cold connection pool). `QGW_RATE_GUARD_MS` covers the usual jitter; past it, the
upstream saw a few calls over the limit in a window (bench/ratelimit.py, two dispatchers at
1,000 a second: up to 1,024 in the first second). So each call's delay from its claim to its
request headers leaving is measured, and its entry in the sliding-window log moves later by
that much (lua/sent-1.lua): later admissions are checked against the real sends.

The entries of an endpoint's further sliding-window limits (docs/api.md `limits`) move with it: a
per-cost limit does not pace, so it admits a whole window's units at once, and the burst that
met cold connections reached the upstream more than the guard late (bench/ratelimit.py, 200
cost units a second, one dispatcher: up to 330 units in a second before they moved).

The moves are batched (one script call per log every FLUSH_S): an admission that could
collide with a moved entry comes about one interval later, long after the batch landed.
Fixed windows and token buckets keep no entry per call; the guard alone covers them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.core.keys import Keys
from app.core.scripts import Lua
from app.endpoints import EndpointConfig

log = logging.getLogger(__name__)
FLUSH_S = 0.02
MIN_DELAY_MS = 2  # below this the guard covers it, and moving every entry would cost Redis work


@dataclass
class SendTimes:
    redis: Redis
    keys: Keys
    script: Lua
    _moves: dict[str, list[str]] = field(default_factory=dict)
    _timer: asyncio.TimerHandle | None = None
    _flushing: set[asyncio.Task[None]] = field(default_factory=set)

    def sent(self, endpoint_id: str, member: str, admitted_at: float,
             logs: Sequence[tuple[str, str]] = ()) -> None:
        """The call admitted under `member` at `admitted_at` (loop time) has just left.
        `logs`: (key, member) of every sliding-window log its admission entered (sliding_logs);
        none given, the endpoint's main log under `member`."""
        loop = asyncio.get_running_loop()
        delay = round((loop.time() - admitted_at) * 1000)
        if delay < MIN_DELAY_MS:
            return
        for key, entry in logs or [(self.keys.ratelimit(endpoint_id, "sliding_window"), member)]:
            self._moves.setdefault(key, []).extend((entry, str(delay)))
        if self._timer is None:
            self._timer = loop.call_later(FLUSH_S, self._flush_soon)

    def _flush_soon(self) -> None:
        self._timer = None
        task = asyncio.create_task(self.flush())
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def flush(self) -> None:
        """Send the moves gathered so far, one script call per log, in one round trip."""
        moves, self._moves = self._moves, {}
        if not moves:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, args in moves.items():
                    await self.script(keys=[key], args=args, client=pipe)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # best effort: the guard still covers most
            log.warning("could not record when %d calls left: %s",
                        sum(len(a) // 2 for a in moves.values()), exc)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self.flush()
        if self._flushing:
            await asyncio.wait(self._flushing, timeout=1)
            for task in self._flushing:
                task.cancel()


def sliding_logs(keys: Keys, endpoint: EndpointConfig, member: str, cost: int
                 ) -> list[tuple[str, str]]:
    """(key, member) of each sliding-window log an admission under `member` of a task costing
    `cost` entered (claim-12.lua, limits.lua): the main limit's, and the further limits'; a
    per-cost log names the entry by the units it spent too."""
    e = endpoint.id
    logs = []
    if endpoint.limiter == "sliding_window" and endpoint.rate > 0:
        logs.append((keys.ratelimit(e, "sliding_window"), member))
    for x in endpoint.limits:
        if x.limiter == "sliding_window":
            entry = f"{member}:{min(cost, x.rate)}" if x.per == "cost" else member
            logs.append((keys.further_limit(e, x.limiter, x.per, x.rate, x.interval_ms), entry))
    return logs
