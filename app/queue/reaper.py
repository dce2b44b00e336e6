"""The reaper: returns claims whose lease ran out to their queues (or fails them after their
last attempt), wakes endpoints a lost marker or an unretried limit left asleep. Safe in every
dispatcher process at once: each script handles an expired id once, whoever runs it first."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.core.keys import Keys
from app.core.registry import EndpointRegistry
from app.core.scripts import Scripts
from app.lifecycle import Ttls
from app.queue.fairness import starvation_keys
from app.settings import Settings

log = logging.getLogger(__name__)
PROMOTE_GRACE_MS = 250
#: After an outage, time for every dispatcher's heartbeat to renew its leases before reaping
#: (two of its retry periods), or every call in flight through the outage would look abandoned.
SETTLE_S = 1.0


@dataclass
class Reaper:
    redis: Redis
    keys: Keys
    scripts: Scripts
    registry: EndpointRegistry
    settings: Settings

    async def run(self) -> None:
        outage = False
        while True:
            await asyncio.sleep(self.settings.reap_interval_ms / 1000)
            try:
                if outage:  # Redis is back: let the heartbeats renew leases first
                    await self.redis.ping()
                    await asyncio.sleep(SETTLE_S)
                    outage = False
                await self.reap()
            except (RedisError, OSError) as exc:
                outage = True
                log.warning("reap failed: %s", exc)

    async def reap(self) -> None:
        """Return expired claims of every endpoint, wake limited endpoints nobody retried, and
        wake endpoints with claimable work whose marker was lost."""
        k, done_ms = self.keys, Ttls.of(self.settings).done_ms
        endpoints = self.registry.all()
        async with self.redis.pipeline(transaction=False) as pipe:
            for ep in endpoints:
                await self.scripts.reap(
                    keys=k.of(ep.id, "active", "queue", "wake", "stats", "outbox", "hooks",
                              "probe", *starvation_keys(ep)),
                    args=[ep.id, k.task_prefix(ep.id), ep.max_retries + 1, done_ms, 1000],
                    client=pipe,
                )
            for ep in endpoints:
                if ep.enabled:
                    await self.scripts.nudge(
                        keys=[k.queue(ep.id), k.active(ep.id), k.wake(ep.id),
                              k.delayed(ep.id)],
                        args=[ep.id, ep.max_concurrency], client=pipe)
            for wake, delayed in k.wake_sets():
                await self.scripts.promote(keys=[delayed, wake], args=[PROMOTE_GRACE_MS],
                                           client=pipe)
            # Errors kept apart: on a Cluster a master being failed over must not stop the
            # reaping of the endpoints on the others.
            results = await pipe.execute(raise_on_error=False)
        for ep, res in zip(endpoints, results, strict=False):
            if isinstance(res, Exception):
                continue
            requeued, failed, ended = res
            if requeued or failed or ended:
                log.info("reaped expired leases", extra={
                    "endpoint": ep.id, "requeued": requeued, "failed": failed, "ended": ended})
        if errors := [r for r in results if isinstance(r, Exception)]:
            raise errors[0]
