"""Which dispatchers are alive: each writes `{at_ms, in_flight}` under its ident in one hash
every second (its heartbeat loop), and /metrics counts the entries seen in the last
`ALIVE_MS`.  The stamps are the dispatchers' wall clocks, compared with Redis's: hosts are
expected to keep NTP time, and a skew well under `ALIVE_MS` does not matter."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from app.queue.keys import Keys

EVERY_S = 1.0
ALIVE_MS = 10_000


def announce(pipe: Any, keys: Keys, ident: str, in_flight: int) -> None:
    """Queue this dispatcher's entry on a pipeline (it rides the lease renewals' round trip)."""
    pipe.hset(keys.dispatchers, ident, json.dumps({"at_ms": int(time.time() * 1000),
                                                    "in_flight": in_flight}))


async def leave(redis: Redis, keys: Keys, ident: str) -> None:
    """A dispatcher that stops says so, rather than count as alive for another ten seconds."""
    await redis.hdel(keys.dispatchers, ident)


@dataclass(frozen=True)
class Dispatchers:
    alive: int
    in_flight: int  # calls running in the live dispatchers
    stale: list[str]  # entries older than ALIVE_MS (crashed or stuck), for the reader to prune


def tally(raw: dict[str, str], now_ms: int) -> Dispatchers:
    alive = in_flight = 0
    stale = []
    for ident, value in raw.items():
        try:
            entry = json.loads(value)
            fresh = now_ms - int(entry["at_ms"]) <= ALIVE_MS
        except (ValueError, KeyError, TypeError):
            fresh, entry = False, {}
        if fresh:
            alive += 1
            in_flight += int(entry.get("in_flight", 0))
        else:
            stale.append(ident)
    return Dispatchers(alive, in_flight, stale)
