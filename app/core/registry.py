"""SQL tables mirrored into Redis, so every process sees a change within a second.

SQL is the source of truth; the admin writes there, then into a Redis hash, bumps a version and
publishes on a channel.  Each process keeps a local copy: it reloads when a message arrives,
and polls the version twice a second in case a message was missed (pub/sub does not queue).
If the mirror is gone (a Redis that lost its data), the first process to notice rebuilds it
from SQL.  The hot paths (submit, claim, auth) then read only process memory.

A write can reach SQL and not the mirror: Redis down (or restarted from an append-only file
that missed it) between the two, or a commit whose answer never came. So the mirror is also
reconciled with SQL: at once in every process when Redis comes back after an outage (or a
publication failed), and every RECONCILE_S in one process. An admin call that answered 503
after its SQL write has committed is therefore applied everywhere within seconds of Redis
answering again, never half-done for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from app.core.keys import Keys
from app.core.loop import STORE_ERRORS
from app.core.scripts import Lua, source
from app.endpoints import EndpointConfig, url_key

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.5
#: How long a change takes to reach every process, at most: two polls and a margin.
SPREAD_S = 2 * POLL_S + 0.1
#: How often the mirror is checked against SQL when nothing went wrong (one process a turn).
RECONCILE_S = 10.0
RECONCILE_RETRY_S = 1.0


class Mirror(Generic[T]):
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        table: str,
        parse: Callable[[dict[str, Any]], T],
        load_sql: Callable[[], Awaitable[dict[str, str]]],
        marker: Callable[[str], str] | None = None,
    ) -> None:
        """`marker(id)`: a hash whose field `id` also says the row exists (Keys.live), kept
        where the scripts that need to know can read it in their own slot."""
        self.redis, self.table, self._parse, self._load_sql = redis, table, parse, load_sql
        self._marker = marker
        self._put_right = Lua(redis, source("mirror"))
        self.hash_key = getattr(keys, table)
        self.version_key, self.channel = keys.version(table), keys.channel(table)
        self.items: dict[str, T] = {}
        self.version: str | None = None
        self.listeners: list[Callable[[set[str]], None]] = []
        self.turn_key = keys.lock(f"reconcile:{table}")
        self._held_prefix = keys.withdrawn(table)
        # Set: reconcile as soon as Redis answers (at start, after an outage, a failed put).
        self._stale = asyncio.Event()
        self._stale.set()

    def mark_stale(self) -> None:
        """Reconcile with SQL as soon as the stores answer."""
        self._stale.set()

    async def put(self, item_id: str, value: dict[str, Any] | None, hold_s: float = 0) -> None:
        """Publish one row (None removes it); call after the SQL write has committed.
        With `hold_s`, a removal comes ahead of its SQL delete: the reconcile leaves the row
        out meanwhile (for `hold_s` at most, should the deleting process die)."""
        try:
            # The marker first: a row being removed stops admitting submits before it leaves
            # the registry, a new one admits them as soon as a process knows it.
            await self._mark([] if value is None else [item_id], [item_id] if value is None
                             else [])
            async with self.redis.pipeline(transaction=True) as pipe:
                if value is None:
                    pipe.hdel(self.hash_key, item_id)
                else:
                    pipe.hset(self.hash_key, item_id, json.dumps(value))
                if value is None and hold_s > 0:
                    pipe.set(self._held_prefix + item_id, "1", px=int(hold_s * 1000))
                else:
                    pipe.delete(self._held_prefix + item_id)
                pipe.incr(self.version_key)
                await pipe.execute()
            # Outside the transaction: a channel is in no slot a Cluster transaction could
            # name. A lost message costs a poll (watch).
            await self.redis.publish(self.channel, item_id)
        except (RedisError, OSError):
            self._stale.set()  # the SQL write stands: the mirror catches up with it
            raise
        await self.refresh()

    async def refresh(self) -> None:
        version: str | None = await self.redis.get(self.version_key)  # type: ignore[assignment]
        if version is None:
            await self._rebuild()
            version = await self.redis.get(self.version_key)  # type: ignore[assignment]
        if version == self.version:
            return
        raw: dict[str, str] = await self.redis.hgetall(self.hash_key)  # type: ignore[assignment]
        items = {k: self._parse(json.loads(v)) for k, v in raw.items()}
        changed = {k for k in items.keys() | self.items.keys() if items.get(k) != self.items.get(k)}
        self.items, self.version = items, version
        for listener in self.listeners:
            listener(changed)

    async def _rebuild(self) -> None:
        rows = await self._load_sql()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.hash_key)
            if rows:
                pipe.hset(self.hash_key, mapping=rows)  # type: ignore[arg-type]
            pipe.incr(self.version_key)
            await pipe.execute()
        await self._mark(list(rows), [])
        log.info("rebuilt the %s mirror from SQL (%d rows)", self.table, len(rows))

    async def watch(self) -> None:
        """Keep the local copy fresh until cancelled."""
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    while True:
                        await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
                        await self.refresh()
            except (RedisError, OSError) as exc:
                log.warning("%s mirror: redis error %s; retrying", self.table, exc)
                self._stale.set()  # an admin write may have missed the mirror meanwhile
                await asyncio.sleep(1)

    async def reconcile(self) -> bool:
        """Make the Redis hash what SQL says; True if it had to change.

        A compare-and-set on the version (lua/mirror-2.lua): an admin write published between
        the reads and this write (its SQL state possibly newer than what was read here) makes
        this one give way."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.version_key)
            pipe.hgetall(self.hash_key)
            version, raw = await pipe.execute()
        rows = await self._load_sql()
        want = {k: json.loads(v) for k, v in rows.items()}
        gone = [k for k in raw if k not in want]
        changed = {k: v for k, v in rows.items() if _parsed(raw.get(k)) != want[k]}
        back = [k for k in changed if k not in raw]
        held: set[str] = set()
        if back:  # rows withdrawn ahead of their delete stay out
            # MGET by name: the keys share the registry's tag (one slot) on a Cluster.
            marks: list[str | None] = await self.redis.execute_command(  # type: ignore[no-untyped-call]
                "MGET", *[self._held_prefix + k for k in back])
            held = {k for k, h in zip(back, marks, strict=True) if h is not None}
            for k in held:
                del changed[k]
        # Markers may have been lost on their own (a failover of their slot's master).
        await self._mark([k for k in want if k not in held], gone)
        if not gone and not changed:
            return False
        pairs = [x for kv in changed.items() for x in kv]
        if not await self._put_right([self.hash_key, self.version_key],
                                     [version or "", len(gone), *gone, *pairs]):
            raise WatchError("an admin write came in between")  # it published its own change
        await self.redis.publish(self.channel, "*")
        log.warning("the %s mirror disagreed with SQL (%d gone, %d changed): put right",
                    self.table, len(gone), len(changed))
        await self.refresh()
        return True

    async def _mark(self, present: list[str], absent: list[str]) -> None:
        if self._marker is None or not (present or absent):
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for item_id in present:
                pipe.hset(self._marker(item_id), item_id, "1")
            for item_id in absent:
                pipe.hdel(self._marker(item_id), item_id)
            await pipe.execute()

    async def keep_reconciled(self) -> None:
        """Until cancelled: reconcile when marked stale (in every process, retried until
        it succeeds) and every RECONCILE_S (in the one process that takes the turn)."""
        while True:
            try:
                async with asyncio.timeout(RECONCILE_S):
                    await self._stale.wait()
            except TimeoutError:
                pass
            forced = self._stale.is_set()
            self._stale.clear()
            try:
                if forced or await self.redis.set(self.turn_key, "1", nx=True,
                                                  px=int(RECONCILE_S * 1000)):
                    await self.reconcile()
            except WatchError:  # an admin write came in between: look again shortly
                self._stale.set()
            except STORE_ERRORS as exc:
                self._stale.set()
                log.debug("%s mirror: reconcile failed (%s); retrying", self.table, exc)
            except Exception:  # a bug must not end the loop silently and for good
                log.exception("%s mirror: reconcile failed", self.table)
            if self._stale.is_set():
                await asyncio.sleep(RECONCILE_RETRY_S)


def _parsed(raw: str | None) -> Any:
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:  # a damaged entry: SQL's copy replaces it
        return None


class EndpointRegistry:
    """The endpoints this process serves, found by id or by target URL."""

    def __init__(self, mirror: Mirror[EndpointConfig]) -> None:
        self.mirror = mirror
        self._by_url: dict[tuple[str, str, int, str], EndpointConfig] = {}
        mirror.listeners.append(self._index)

    def _index(self, _: set[str]) -> None:
        self._by_url = {e.key: e for e in self.mirror.items.values()}

    def get(self, endpoint_id: str) -> EndpointConfig | None:
        return self.mirror.items.get(endpoint_id)

    def all(self) -> list[EndpointConfig]:
        return list(self.mirror.items.values())

    def match(self, url: str) -> EndpointConfig | None:
        key = url_key(url)
        return self._by_url.get(key) if key else None


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0) -> None:
    """Cancel tasks and wait for them, cancelling again as needed.

    redis-py may turn a cancellation that lands mid-command into a connection error, which a
    retry loop then swallows; cancelling once more ends such a loop on its next await.
    """
    pending = set(tasks)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pending and asyncio.get_running_loop().time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    if pending:
        log.warning("%d tasks did not stop", len(pending))
