"""Which dispatchers are alive, and how many calls each has in flight: every dispatcher
process writes one field of one hash every second (`Keys.dispatchers`, with the heartbeat that
tells its container's health check it is alive: app/healthcheck.py), never once per task.
Readers skip a heartbeat older than STALE_S and delete one older than PRUNE_S (a process that
died without saying goodbye). Times are each process's own clock: a skew of a few seconds
between hosts only shifts the ages shown.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from app.core.keys import Keys

if TYPE_CHECKING:
    from app.queue.dispatcher import Dispatcher

STALE_S = 5.0
PRUNE_S = 60.0
TOP_ENDPOINTS = 20  # per-endpoint counts a heartbeat carries, the busiest


async def announce(redis: Redis, keys: Keys, dispatcher: Dispatcher) -> None:
    busiest = dict(dispatcher.per_endpoint.most_common(TOP_ENDPOINTS))
    await redis.hset(keys.dispatchers, dispatcher.ident, json.dumps({
        "in_flight": len(dispatcher.inflight), "capacity": dispatcher.capacity,
        "per_endpoint": {e: n for e, n in busiest.items() if n > 0},
        "at": int(time.time() * 1000)}))


async def forget(redis: Redis, keys: Keys, ident: str) -> None:
    """A dispatcher that stops cleanly leaves the list at once."""
    await redis.hdel(keys.dispatchers, ident)


async def alive(redis: Redis, keys: Keys) -> list[dict[str, Any]]:
    """The dispatchers heard from in the last STALE_S, busiest first."""
    now = time.time() * 1000
    out, dead = [], []
    for ident, raw in (await redis.hgetall(keys.dispatchers)).items():
        try:
            beat = json.loads(raw)
            age_s = (now - int(beat["at"])) / 1000
        except (ValueError, KeyError, TypeError):
            dead.append(ident)
            continue
        if age_s > PRUNE_S:
            dead.append(ident)
        elif age_s <= STALE_S:
            out.append({"id": ident, "in_flight": int(beat.get("in_flight", 0)),
                        "capacity": beat.get("capacity"),
                        "per_endpoint": beat.get("per_endpoint", {}),
                        "age_s": round(max(age_s, 0.0), 1)})
    if dead:
        await redis.hdel(keys.dispatchers, *dead)
    return sorted(out, key=lambda d: (-d["in_flight"], d["id"]))
