"""Pending expiry: a task still pending QGW_PENDING_TTL_S after submit becomes `expired`,
leaves its queue and never runs. The claim script already refuses such a task when it reaches
the head of its queue; this sweep marks the ones further back on time, so their owners see
`expired` (and SQL gets them) even while the queue does not move."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from app.core.keys import Keys
from app.core.registry import EndpointRegistry
from app.core.scripts import Scripts
from app.lifecycle import Ttls

#: Bounds of one script run (it blocks Redis meanwhile): expirations, and queue heads looked at.
BATCH, STEPS = 200, 400
#: Rounds per sweep when a run stopped at a bound; the rest waits for the next sweep.
MAX_ROUNDS = 50


@dataclass
class ExpirySweep:
    redis: Redis
    scripts: Scripts
    keys: Keys
    registry: EndpointRegistry
    ttls: Ttls

    async def sweep(self) -> int:
        """Expire what is due on every endpoint; returns how many tasks expired."""
        k, total = self.keys, 0
        todo = [e.id for e in self.registry.all()]
        for _ in range(MAX_ROUNDS):
            if not todo:
                break
            async with self.redis.pipeline(transaction=False) as pipe:
                for e in todo:
                    await self.scripts.expire(
                        keys=k.of(e, "queue", "stats", "outbox", "deadlines", "hooks"),
                        args=[k.task_prefix(e), self.ttls.done_ms, BATCH, STEPS], client=pipe)
                results = await pipe.execute()
            total += sum(int(r[0]) for r in results)
            todo = [e for e, r in zip(todo, results, strict=True) if int(r[1])]
        return total
