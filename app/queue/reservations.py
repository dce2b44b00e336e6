"""A submit's first step on a Redis Cluster: the caller's Idempotency-Key and daily quota.

Their keys carry the user's tag, the queue the endpoint's, so no one script can take both
(docs/design.md "Scaling out"). `take` checks and counts them at once (lua/reserve-2.lua: exact
under races), the task is queued next, and `give_back` returns them when it is not.

What two steps add, and how each case stays right:
- the key is taken for a moment only (`settle_s`, the time an enqueue may take), and given its
  whole TTL once the task is queued (`confirm`): if the queueing fails (the queue's master
  died, the process was killed), the key frees itself, so the retry the 503 asked for makes the
  task rather than a 409 naming a task that never was; a queue that refused the task (full,
  endpoint gone) gives it back at once;
- two submits with one key at once: the second sees the first's id before its task exists and
  waits out that moment, finding the task (a duplicate, as on one Redis) or taking the key;
- a key with its whole TTL whose task is gone was confirmed: the task finished and was let go
  (409, as on one Redis);
- with QGW_REDIS_WAIT_REPLICAS, the reservation is confirmed by replicas too: a failover of the
  user's master must not drop a key whose task is queued (a retry would make a second task).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.core.keys import Keys
from app.core.loop import STORE_ERRORS
from app.core.scripts import Scripts
from app.errors import ApiError
from app.lifecycle.results import ResultStore

log = logging.getLogger(__name__)
POLL_S = 0.05


@dataclass
class Reservation:
    keys: list[str]  # the Idempotency-Key's, the quota's
    args: list[Any]  # task id, '1' to honour the key, its first hold (ms), daily quota
    day_end: int = 0  # the day the quota counted the task in (unreserve-2.lua)


@dataclass
class Reservations:
    redis: Redis
    keys: Keys
    scripts: Scripts
    results: ResultStore | None
    wait_replicas: int
    settle_s: float  # how long an enqueue may still land after its caller gave up on it
    ttl_ms: int  # an Idempotency-Key's whole life

    def reservation(self, keys: list[str], task_id: str, honour: bool,
                    quota: int) -> Reservation:
        hold_ms = int(self.settle_s * 1000)
        return Reservation(keys, [task_id, "1" if honour else "0", hold_ms, quota])

    async def take(self, r: Reservation, user_id: int) -> list[Any]:
        """reserve-2.lua's answer: {'ok', day end} | {'dup', first id} | {'quota', ms}."""
        res = await self._reserve(r)
        if res[0] != "dup":
            return self._kept(r, res)
        first, left_ms = str(res[1]), int(res[2])
        if left_ms > r.args[2]:  # confirmed: its task was queued (and may have ended since)
            return ["dup", first]
        # Held for a moment: the first submit is between its two steps, or its queueing
        # failed and the key frees itself when the moment ends.
        deadline = time.monotonic() + left_ms / 1000 + POLL_S
        while time.monotonic() < deadline:
            if not await self._missing(first, user_id):
                return ["dup", first]
            await asyncio.sleep(POLL_S)
        res = await self._reserve(r)  # the key is free again, or another submit took it
        return self._kept(r, res) if res[0] != "dup" else ["dup", res[1]]

    async def confirm(self, r: Reservation) -> None:
        """The task is queued: its key holds for its whole TTL. Unconfirmed, the task stands
        (it is queued) and the key lapses after its moment: only a resubmit after that would
        make a second task, so the caller is answered 202 all the same."""
        if r.args[1] != "1":
            return
        try:
            await self.scripts.confirm(keys=r.keys[:1], args=[r.args[0], self.ttl_ms])
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("queued, but its Idempotency-Key could not be kept: %s", exc,
                        extra={"task_id": r.args[0]})

    async def give_back(self, r: Reservation) -> None:
        await self.scripts.unreserve(keys=r.keys, args=[r.args[0], r.args[1], r.day_end])

    async def _reserve(self, r: Reservation) -> list[Any]:
        if not self.wait_replicas:
            return list(await self.scripts.reserve(keys=r.keys, args=r.args))
        timeout_ms = max(1, int(self.settle_s * 500))
        res, acked = await self.scripts.reserve.call_and_wait(
            r.keys, r.args, self.wait_replicas, timeout_ms)
        if res[0] == "ok" and acked < self.wait_replicas:
            await self.give_back(Reservation(r.keys, r.args, int(res[1])))
            raise ApiError(503, "redis_unavailable",
                           f"{acked} of {self.wait_replicas} Redis replicas confirmed the "
                           "Idempotency-Key and quota in time; nothing was queued, retry",
                           {"Retry-After": "1"})
        return list(res)

    @staticmethod
    def _kept(r: Reservation, res: list[Any]) -> list[Any]:
        if res[0] == "ok":
            r.day_end = int(res[1])
        return res

    async def _missing(self, task_id: str, user_id: int) -> bool:
        """Neither in Redis nor, once Redis let it go, in SQL."""
        if await self.redis.exists(self.keys.task(task_id)):
            return False
        if self.results is None:
            return True
        try:
            return await self.results.get(task_id, user_id) is None
        except STORE_ERRORS:
            return False  # cannot tell: never take a key over on a guess
