"""History the server keeps, so a dashboard opened (or reloaded) now shows the last hour:
every INTERVAL_MS one process samples each endpoint's depth, in flight and cumulative
counters into a capped list per endpoint (`Keys.history`, newest first, KEEP samples).

Every dispatcher process ticks; a per-interval lock key (SET NX) lets exactly one of them take
each sample, and another takes over within a tick when that one dies. The list is deleted with
its endpoint (app/runtime.py) and expires if nobody samples it any more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from app.core.keys import Keys
from app.core.registry import EndpointRegistry

INTERVAL_MS = 10_000
KEEP = 360  # an hour
TICK_S = 2.0
#: One sample: when (ms), depth, in flight, finished (completed + failed), failed; the last two
#: are counters, so a reader takes throughput from the difference of two samples.
FIELDS = ("t", "depth", "in_flight", "done", "failed")


@dataclass
class HistorySampler:
    redis: Redis
    keys: Keys
    registry: EndpointRegistry
    _slot: int = -1

    async def tick(self) -> bool:
        """Take this interval's sample unless another process has; True if this one did."""
        now = int(time.time() * 1000)
        slot = now // INTERVAL_MS
        if slot == self._slot:
            return False
        self._slot = slot
        if not await self.redis.set(self.keys.lock(f"history:{slot}"), "1", nx=True,
                                    px=2 * INTERVAL_MS):
            return False
        await self.sample(now)
        return True

    async def sample(self, now: int) -> None:
        k, ids = self.keys, [e.id for e in self.registry.all()]
        if not ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in ids:
                pipe.zcard(k.queue(e))
                pipe.zcard(k.active(e))
                pipe.hmget(k.stats(e), ["completed", "failed"])
            raw = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for i, e in enumerate(ids):
                depth, in_flight, (completed, failed) = raw[3 * i:3 * i + 3]
                done = int(completed or 0) + int(failed or 0)
                pipe.lpush(k.history(e), f"{now},{depth},{in_flight},{done},{int(failed or 0)}")
                pipe.ltrim(k.history(e), 0, KEEP - 1)
                pipe.pexpire(k.history(e), (KEEP + 6) * INTERVAL_MS)
            await pipe.execute()


async def read(redis: Redis, keys: Keys, endpoint_ids: list[str]) -> dict[str, list[list[int]]]:
    """Each endpoint's samples, oldest first, each as the integers of FIELDS."""
    async with redis.pipeline(transaction=False) as pipe:
        for e in endpoint_ids:
            pipe.lrange(keys.history(e), 0, KEEP - 1)
        raw: list[Any] = await pipe.execute()
    out = {}
    for e, samples in zip(endpoint_ids, raw, strict=True):
        rows = []
        for s in reversed(samples):
            try:
                rows.append([int(v) for v in str(s).split(",")])
            except ValueError:
                continue  # not ours: skip rather than fail the page
        out[e] = rows
    return out
