"""The dispatcher's ear for cancelled calls: a running offline call cancelled (cancel-9.lua)
is announced on its endpoint's cancel channel, and the dispatcher holding its lease aborts it.

One pattern subscription per dispatcher covers every endpoint, present and future, on one Redis
and on a Cluster alike (a PUBLISH reaches every node). A message lost while the connection was
down is not missed for long: the lease renewal answers "cancelled" too (lua/extend-3.lua), a
third of a lease later at most.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
READ_S = 30.0  # longest quiet read (the connection's health is checked on each)
RETRY_S = 1.0


async def listen(redis: Redis, pattern: str, on_cancel: Callable[[str], None],
                 ready: asyncio.Event | None = None) -> None:
    """Call `on_cancel(task_id)` for each cancel heard, until cancelled; `ready` is set once
    the subscription stands (again after each reconnect)."""
    while True:
        try:
            async with redis.pubsub() as pubsub:
                await pubsub.psubscribe(pattern)
                while True:
                    msg: Any = await pubsub.get_message(timeout=READ_S)
                    if msg is None:
                        continue
                    if msg["type"] == "psubscribe" and ready is not None:
                        ready.set()
                    elif msg["type"] == "pmessage":
                        on_cancel(str(msg["data"]))
        except (RedisError, OSError) as exc:
            log.warning("cancel channel: redis error %s; reconnecting", exc)
            if ready is not None:
                ready.clear()
            await asyncio.sleep(RETRY_S)
