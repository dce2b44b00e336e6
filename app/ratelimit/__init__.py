"""Per-endpoint rate limits: sliding window, fixed window, token bucket; Lua behind one interface.

The limiters live in `lua/includes/ratelimit.lua`.  The dispatcher passes each call through two
of them with the same limit:
- at claim, inside the claim script (`claim-5.lua`), atomically with the pop: this paces the
  claims and names the exact moment the endpoint is worth another try;
- right before it sends, on the endpoint's `sent` key (`Limiter.wait(e, sent=True)`): a
  claimed call can reach the upstream tens of milliseconds after its claim, with varying
  delay (a claim starts a batch of calls at once), and only this second check makes the bound
  hold where the upstream sees the calls.  This check also paces the calls (one per
  interval / rate, with `guard_ms` of catch-up): a whole window admitted at once would leave
  over tens or hundreds of ms as one process pushes it out, and its late part would share an
  upstream window with the next window's calls.  It costs one round trip per call of a
  rate-limited endpoint.
Both use a `guard_ms` margin for the remaining jitter between the check and the upstream
(see ratelimit.lua for what it does to each kind).  Every check uses the Redis clock, so
processes with skewed clocks agree.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import get_args

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from app.endpoints import EndpointConfig
from app.endpoints import Limiter as Kind
from app.queue.keys import Keys
from app.queue.scripts import source

KINDS: tuple[Kind, ...] = get_args(Kind)
GUARD_SHARE = 20  # the guard never takes more than interval / 20 (5 % of the rate)


@dataclass(frozen=True, slots=True)
class Limit:
    """At most `rate` admissions per `interval_ms`; rate 0 means no limit."""

    kind: Kind = "sliding_window"
    rate: int = 0
    interval_ms: int = 1000
    guard_ms: int = 0

    @classmethod
    def of(cls, endpoint: EndpointConfig, guard_ms: int = 0) -> Limit:
        guard = min(guard_ms, endpoint.interval_ms // GUARD_SHARE)
        return cls(endpoint.limiter, endpoint.rate, endpoint.interval_ms, guard)


class Limiter:
    """Acquire admissions under one limit, keyed per endpoint as the dispatcher keys them."""

    def __init__(self, redis: Redis, limit: Limit, keys: Keys | None = None) -> None:
        if limit.kind not in KINDS:
            raise ValueError(f"unknown limiter {limit.kind!r}; one of {', '.join(KINDS)}")
        self.redis, self.limit, self.keys = redis, limit, keys or Keys()
        self._script: AsyncScript = redis.register_script(source("ratelimit"))

    def key(self, endpoint_id: str, sent: bool = False) -> str:
        return self.keys.ratelimit(endpoint_id, self.limit.kind, sent)

    async def acquire(self, endpoint_id: str, member: str | None = None,
                      sent: bool = False) -> int:
        """0 if admitted (and recorded), else the exact ms until an admission could succeed.

        `member` names the admission in a sliding window; it must be unique (a fresh random
        one by default): two admissions with one member would count once.  `sent`: the check
        right before a call, on its own keys and paced.
        """
        lim = self.limit
        wait, _now = await self._script(
            keys=[self.key(endpoint_id, sent), self.keys.pace(endpoint_id)],
            args=[lim.kind, lim.rate, lim.interval_ms, member or secrets.token_hex(8),
                  lim.guard_ms, "1" if sent else "0"],
        )
        return int(wait)

    async def wait(
        self, endpoint_id: str, sent: bool = False,
        sleep: Callable[[float], Awaitable[bool | None]] = asyncio.sleep,
    ) -> bool:
        """Return once admitted, sleeping exactly as long as the limiter says between tries.

        `sleep(seconds)` may cut a wait short by returning True (its caller is stopping);
        then this returns False, admitted to nothing."""
        if self.limit.rate <= 0:
            return True
        while True:
            wait_ms = await self.acquire(endpoint_id, sent=sent)
            if wait_ms == 0:
                return True
            if await sleep(wait_ms / 1000) is True:
                return False
