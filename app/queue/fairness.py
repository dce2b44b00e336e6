"""Fair turns inside a priority band (endpoint `fairness: "per_user"` or "weighted"), as
Python reads them.

lua/includes/fairness.lua gives each new task its score; this module only predicts, for the
deadline check of a submit that sets `max_wait_s`, where such a task would land."""

from __future__ import annotations

import math

from redis.asyncio import Redis

from app.core.keys import Keys
from app.endpoints import EndpointConfig

PRIORITY_STEP = 8_796_093_022_208  # 2^43: one priority band of a queue score (submit-11.lua)
TURN_STEP = 8192  # 2^13: one turn inside a band (fairness.lua FAIR_TURN)
MAX_TURN = 2**30 - 1  # fairness.lua FAIR_MAX_TURN: a band never reaches the next one
WEIGHT_SCALE = 128  # fairness.lua FAIR_SCALE: units of a turn on a weighted endpoint


def starvation_keys(endpoint: EndpointConfig) -> tuple[str, ...]:
    """The arrival index's name (Keys.arrivals) for an endpoint that bounds starvation: submit
    and claim take it after their other keys; nothing for the others."""
    return ("arrivals",) if endpoint.max_starvation_s else ()


def fair_arg(endpoint: EndpointConfig, user_id: int, weight: int) -> str:
    """submit-11.lua's ARGV[11]: '' (fifo), the user id (per_user), "<user id>/<weight>"
    (weighted)."""
    if endpoint.fairness == "per_user":
        return str(user_id)
    if endpoint.fairness == "weighted":
        return f"{user_id}/{weight}"
    return ""


async def fair_ahead(redis: Redis, keys: Keys, endpoint: str, priority: int,
                     user_id: int, weight: int = 0) -> int:
    """How many tasks would be ahead of a task `user_id` submitted now at `priority`: those of
    higher bands, and of its own band up to the end of the turn it would take (its unit of a
    turn, weighted: `weight` > 0). The same rule as fairness.lua; a submit or claim in between
    can move it by a few places."""
    queue, band = keys.queue(endpoint), -priority * PRIORITY_STEP
    scale, w = (WEIGHT_SCALE, weight) if weight else (1, 1)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrangebyscore(queue, band, f"({band + PRIORITY_STEP}", start=0, num=1,
                           withscores=True)
        pipe.zrevrangebyscore(queue, f"({band + PRIORITY_STEP}", band, start=0, num=1,
                              withscores=True)
        pipe.hget(keys.turns(endpoint, priority), str(user_id))
        head, tail, last = await pipe.execute()
    turn = 0.0
    if head and tail:  # both, or the band emptied between the two reads
        current = ((int(head[0][1]) - band) // TURN_STEP) / scale
        tail_unit = (int(tail[0][1]) - band) // TURN_STEP
        last_turn = float(last) if last is not None else -1 / w
        if math.floor(last_turn * scale + 1e-6) > tail_unit:  # past the tail's unit only
            last_turn = tail_unit / scale
        turn = min(max(current, last_turn + 1 / w), MAX_TURN / scale)
    unit = math.floor(turn * scale + 1e-6)
    count: int = await redis.zcount(queue, "-inf", f"({band + (unit + 1) * TURN_STEP}")
    return count
