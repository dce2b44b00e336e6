"""Per-endpoint rate limits: sliding window, fixed window, token bucket; Lua behind one interface.

The limiters live in `lua/includes/ratelimit.lua`.  The dispatcher checks them inside the claim
script (`claim-12.lua`), atomically with the pop; `Limiter` runs the very same code alone, for
retries and for callers that want a limit without a queue.  Every check uses the Redis clock, so
processes with skewed clocks agree.

The bound must hold where the upstream sees the calls, not only where they are admitted.  A
window limiter may admit a whole window at once, and one process pushes such a batch out over
tens or hundreds of ms: checked only at admission, the upstream saw up to twice the rate in a
window (bench/ratelimit.py).  So the window limiters also pace (one call per interval / rate,
with `guard_ms` of catch-up), and `guard_ms` is a margin for the jitter left between the check
and the upstream: it widens a sliding window, closes a fixed window's last ms and comes off a
token bucket's burst tolerance (see ratelimit.lua). A sliding window's entries are moreover
moved to when their calls really left (sent.py), so it widens by only half the guard.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import get_args

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from app.core.keys import Keys
from app.core.scripts import source
from app.endpoints import EndpointConfig
from app.endpoints import Limiter as Kind

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


def further_limits(endpoint: EndpointConfig, guard_ms: int) -> list[str | int]:
    """The endpoint's further limits as claim-12.lua (ARGV[12..]) and ack-7.lua (ARGV[4..]) take
    them: a count, then kind, rate, interval, guard, per each; nothing when it has none, so such
    an endpoint's claims run exactly as before."""
    if not endpoint.limits:
        return []
    args: list[str | int] = [len(endpoint.limits)]
    for x in endpoint.limits:
        args += [x.limiter, x.rate, x.interval_ms, min(guard_ms, x.interval_ms // GUARD_SHARE),
                 x.per]
    return args


#: The endpoint fields a limit is made of: an edit of any of them resets the pacing state.
LIMIT_FIELDS = frozenset({"limiter", "rate", "interval_ms", "limits"})


def pacing_keys(keys: Keys, endpoint: EndpointConfig) -> list[str]:
    """Where the endpoint's limits keep how far ahead they are paced: the main limit's pace,
    each further limit's pace, and a per-cost token bucket's clock (its state is its pace).
    The windows' logs and counts are not among them: they hold what was really sent."""
    e = endpoint.id
    out = [keys.pace(e, endpoint.limiter, endpoint.rate, endpoint.interval_ms)]
    if endpoint.limiter == "token_bucket":
        out.append(keys.ratelimit(e, "token_bucket"))
    for x in endpoint.limits:
        out.append(keys.further_pace(e, x.limiter, x.per, x.rate, x.interval_ms))
        if x.limiter == "token_bucket":
            out.append(keys.further_limit(e, x.limiter, x.per, x.rate, x.interval_ms))
    return out


async def reset_pacing(redis: Redis, keys: Keys, *endpoints: EndpointConfig) -> None:
    """Forget the pacing state of these configurations of an endpoint (before and after an
    edit): an operator who saves a limit again gets it paced afresh, whatever state a bad
    figure or a bug left behind (a pace pushed years out is undone by editing the limit)."""
    names = sorted({k for ep in endpoints for k in pacing_keys(keys, ep)})
    await redis.unlink(*names)  # all in the endpoint's slot
    # A dispatcher told to claim again in years must hear of it now (an edit to the same
    # values changes no config, so nothing else wakes it).
    for e in {ep.id for ep in endpoints}:
        await redis.zadd(keys.wake(e), {e: 0})


class Limiter:
    """Acquire admissions under one limit, keyed per endpoint as the dispatcher keys them."""

    def __init__(self, redis: Redis, limit: Limit, keys: Keys | None = None) -> None:
        if limit.kind not in KINDS:
            raise ValueError(f"unknown limiter {limit.kind!r}; one of {', '.join(KINDS)}")
        self.redis, self.limit, self.keys = redis, limit, keys or Keys()
        self._script: AsyncScript = redis.register_script(source("ratelimit"))

    def key(self, endpoint_id: str) -> str:
        return self.keys.ratelimit(endpoint_id, self.limit.kind)

    async def acquire(self, endpoint_id: str, member: str | None = None) -> int:
        """0 if admitted (and recorded), else the exact ms until an admission could succeed.

        `member` names the admission in a sliding window; it must be unique (a fresh random
        one by default): two admissions with one member would count once.
        """
        lim = self.limit
        wait, _now = await self._script(
            keys=[self.key(endpoint_id),
                  self.keys.pace(endpoint_id, lim.kind, lim.rate, lim.interval_ms)],
            args=[lim.kind, lim.rate, lim.interval_ms, member or secrets.token_hex(8),
                  lim.guard_ms],
        )
        return int(wait)

    async def wait(self, endpoint_id: str) -> None:
        """Return once admitted, sleeping exactly as long as the limiter says between tries."""
        while True:
            wait_ms = await self.acquire(endpoint_id)
            if wait_ms == 0:
                return
            await asyncio.sleep(wait_ms / 1000)
