"""How many dispatchers are alive, for /metrics: a tally of the heartbeats every dispatcher
process writes each second (app/queue/heartbeats.py), counted alive for `ALIVE_MS`.  The stamps
are the dispatchers' wall clocks, compared with Redis's: hosts are expected to keep NTP time,
and a skew well under `ALIVE_MS` does not matter."""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.queue.heartbeats import PRUNE_S

ALIVE_MS = 10_000


@dataclass(frozen=True)
class Dispatchers:
    alive: int
    in_flight: int  # calls running in the live dispatchers
    stale: list[str]  # entries past heartbeats.PRUNE_S (crashed), for the reader to prune


def tally(raw: dict[str, str], now_ms: int) -> Dispatchers:
    alive = in_flight = 0
    stale = []
    for ident, value in raw.items():
        try:
            entry = json.loads(value)
            age_ms = now_ms - int(entry["at"])
        except (ValueError, KeyError, TypeError):
            stale.append(ident)
            continue
        if age_ms <= ALIVE_MS:
            alive += 1
            in_flight += int(entry.get("in_flight", 0))
        elif age_ms > PRUNE_S * 1000:
            stale.append(ident)
    return Dispatchers(alive, in_flight, stale)
