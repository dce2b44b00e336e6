"""The Redis side of the outbox: which finished tasks wait for SQL, their fields fetched in
replies of bounded size, and what happens to them once their rows committed.

A finished task's own hash is its record (lua/includes/lifecycle.lua): it has no TTL while its
id is in the endpoint's outbox ZSet, so no outage and no done TTL can take it before SQL has its
row; `saved` gives it the done TTL after the commit (lua/saved-1.lua). The writer never asks
for more than READ_BYTES of results in one round trip (one result larger than that comes
alone), so every reply is read well within the socket timeout and no reply is large enough to
hold up the heartbeats, acks and status reads that share Redis and the connection pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.asyncio import Redis

from app.core.keys import Keys
from app.core.scripts import Lua, source
from app.lifecycle.records import REQUEST_FIELDS, ROW_FIELDS

T = TypeVar("T")

#: Results per Redis round trip. Loopback reads run at hundreds of MB a second, so 4 MiB (or
#: one inline result, of up to QGW_RESULT_INLINE_BYTES) reads in tens of milliseconds.
READ_BYTES = 4 << 20
ROW_OVERHEAD = 256  # bytes a row weighs besides its result


@dataclass(frozen=True, slots=True)
class Waiting:
    """Tasks of one endpoint waiting for SQL, with the size of each one's result."""

    endpoint: str
    legacy: bool  # from the outbox hash of earlier versions (JSON records)
    sizes: list[tuple[str, int]]  # (task id, result bytes; -1 when its hash is gone)


def by_weight(items: Iterable[T], weigh: Callable[[T], int], max_weight: int
              ) -> Iterator[list[T]]:
    """Consecutive groups weighing at most `max_weight` each (a heavier single item alone)."""
    group: list[T] = []
    weight = 0
    for item in items:
        w = weigh(item)
        if group and weight + w > max_weight:
            yield group
            group, weight = [], 0
        group.append(item)
        weight += w
    if group:
        yield group


def by_bytes(sizes: list[tuple[str, int]], max_bytes: int) -> Iterator[list[tuple[str, int]]]:
    """Groups of (task id, result bytes) to read or write together."""
    return by_weight(sizes, lambda item: max(item[1], 0) + ROW_OVERHEAD, max_bytes)


@dataclass
class Outbox:
    redis: Redis
    keys: Keys
    _list: Lua = field(init=False)
    _saved: Lua = field(init=False)
    _rows: Lua = field(init=False)

    def __post_init__(self) -> None:
        self._list = Lua(self.redis, source("outbox"))
        self._saved = Lua(self.redis, source("saved"))
        self._rows = Lua(self.redis, source("rows"))

    async def waiting(self, endpoint: str, limit: int) -> Waiting:
        """Up to `limit` tasks, oldest first (what is left in a legacy outbox before them)."""
        k = self.keys
        res = await self._list(keys=[k.outbox(endpoint), k.outbox_legacy(endpoint)],
                               args=[k.task_prefix(endpoint), limit])
        sizes = [(str(res[i]), int(res[i + 1])) for i in range(1, len(res), 2)]
        return Waiting(endpoint, res[0] == "legacy", sizes)

    async def fetch(self, waiting: Waiting) -> dict[str, dict[str, Any] | None]:
        """Each task's fields (None when it is gone), in round trips of at most READ_BYTES."""
        k, e = self.keys, waiting.endpoint
        out: dict[str, dict[str, Any] | None] = {}
        for group in by_bytes(waiting.sizes, READ_BYTES):
            if waiting.legacy:
                replies = await self.redis.hmget(k.outbox_legacy(e), [tid for tid, _ in group])
            else:  # one script call: an HMGET each in a pipeline cost ~5x the client's CPU
                replies = await self._rows(keys=[k.task(tid) for tid, _ in group],
                                           args=ROW_FIELDS)
            for (tid, _), reply in zip(group, replies, strict=True):
                out[tid] = _record(reply, waiting.legacy)
        return out

    async def requests(self, endpoint: str, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The request fields of these tasks (dead letters: few), one reply."""
        k = self.keys
        replies = await self._rows(keys=[k.task(t) for t in task_ids], args=REQUEST_FIELDS)
        return {t: dict(zip(REQUEST_FIELDS, r, strict=True))
                for t, r in zip(task_ids, replies, strict=True)}

    async def headers(self, task_ids: list[str]) -> dict[str, str | None]:
        """The stored request headers of these tasks (their trace context), one reply."""
        replies = await self._rows(keys=[self.keys.task(t) for t in task_ids],
                                   args=["headers"])
        return {t: r[0] for t, r in zip(task_ids, replies, strict=True)}

    async def saved(self, waiting: Waiting, records: dict[str, dict[str, Any] | None],
                    done_ms: int) -> None:
        """These tasks' rows committed (or they can never have one): out of the outbox, each
        unless it has ended again since its record was read (saved-1.lua)."""
        if not records:
            return
        k, e = self.keys, waiting.endpoint
        if waiting.legacy:
            await self.redis.hdel(k.outbox_legacy(e), *records)
        else:
            prefix = k.task_prefix(e)
            seen = [v for t, rec in records.items() for v in (t, (rec or {}).get("ended_at") or "")]
            await self._saved(keys=[k.outbox(e), *(prefix + t for t in records)],
                              args=[done_ms, *seen])

    async def refused(self, endpoint: str, task_id: str, record: dict[str, Any]) -> None:
        """Keep a record the database refused even without its result, for an operator."""
        await self.redis.hset(self.keys.outbox_refused(endpoint), task_id, json.dumps(record))


def _record(reply: Any, legacy: bool) -> dict[str, Any] | None:
    if legacy:
        if reply is None:
            return None
        try:
            rec = json.loads(reply)
        except ValueError:
            rec = None
        # A malformed one fails in row_from, where it is logged and dropped.
        return rec if isinstance(rec, dict) else {"malformed": reply[:500]}
    if reply[0] is None:  # no user_id: the hash is gone
        return None
    return dict(zip(ROW_FIELDS, reply, strict=True))
