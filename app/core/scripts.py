"""Lua scripts from `lua/`, with `--@include` resolved, registered once per client.

redis-py's `Script` runs EVALSHA and reloads the script on NOSCRIPT (after a Redis restart).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import BusyLoadingError, MovedError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import data_path
from app.core.autopipe import AutoPipeline, PipelineClosed

LUA_DIR = data_path("lua")
_INCLUDE = re.compile(r"^--@include (\S+)$", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The text of `lua/<name>-<n>.lua` with its includes inlined."""
    (path,) = (p for p in LUA_DIR.glob(f"{name}-*.lua") if p.stem[len(name) + 1:].isdigit())
    return _resolve(path)


def _resolve(path: Path) -> str:
    text = path.read_text()
    return _INCLUDE.sub(lambda m: (LUA_DIR / "includes" / m.group(1)).read_text(), text)


async def _each(futures: list[asyncio.Future[Any]]) -> list[Any]:
    """Each one's result or exception, in order (gather's `return_exceptions`, without its
    future and callbacks: these resolve in order anyway)."""
    out: list[Any] = []
    try:
        for fut in futures:
            try:
                out.append(await fut)
            except Exception as exc:
                out.append(exc)
    except BaseException:  # cancelled: nobody reads the others' replies (or errors)
        for fut in futures:
            fut.cancel()
        raise
    return out


class Lua:
    """One script: EVALSHA with the calls of other tasks on one Redis (app/core/autopipe.py),
    on a Cluster straight through `execute_command` (redis-py's Script adds a
    deprecation-checking wrapper that cost about a tenth of a submit), loading it on NOSCRIPT;
    in a pipeline, redis-py's Script (it loads scripts before the pipeline runs)."""

    __slots__ = ("_batched", "_redis", "_script")

    def __init__(self, redis: Redis, text: str, batched: AutoPipeline | None = None) -> None:
        self._redis, self._script = redis, redis.register_script(text)
        self._batched = batched

    async def __call__(
        self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None
    ) -> Any:
        if isinstance(client, ClusterPipeline):
            # redis-py loads scripts before a pipeline of one Redis runs, not before a Cluster
            # pipeline's, and a master just promoted may lack them: the text goes along.
            return client.execute_command("EVAL", self._script.script, len(keys), *keys, *args)
        if client is not None:
            return await self._script(keys=keys, args=args, client=client)
        try:
            if self._batched is not None:
                return await self._batched.execute(*self._evalsha(keys, args))
            return await self._redis.execute_command(  # type: ignore[no-untyped-call]
                *self._evalsha(keys, args))
        except NoScriptError:
            return await self._script(keys=keys, args=args)

    def send(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()
             ) -> tuple[Awaitable[Any], bool]:
        """The call, and whether it has been written to Redis already (on one Redis with a
        connection held): what a caller does next then reaches Redis after it, without
        waiting for its reply. Otherwise it goes when awaited, as a plain call."""
        if self._batched is None:
            return self(keys, args), False
        fut, written = self._batched.execute_now(*self._evalsha(keys, args))
        return self._reloading(fut, keys, args), written

    async def _reloading(self, fut: Awaitable[Any], keys: Sequence[Any], args: Sequence[Any]
                         ) -> Any:
        try:
            return await fut
        except NoScriptError:
            return await self._script(keys=keys, args=args)

    async def repeatable(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """A call that is safe to run twice (it reads, or writes again what it wrote): sent
        once more after its connection was lost. The client never re-sends on its own
        (app/redis_url.py), and a connection left from before a Redis restart can pass the
        pool's check and then fail; a caller reading its task's status must not see a 503
        from Redis that is up. A timeout is not repeated: Redis is slow, and a second try
        would only double the wait for the 503."""
        try:
            return await self(keys, args)
        except RedisConnectionError as exc:
            # Not when Redis is up and still loading (again now would fail), nor when the pool
            # had no free connection in time, nor on shutdown: each would only wait again.
            if isinstance(exc, BusyLoadingError | PipelineClosed) or isinstance(
                    exc.__cause__, TimeoutError):
                raise
            return await self(keys, args)

    @staticmethod
    def together(redis: Redis, calls: Sequence[tuple[Lua, Sequence[Any], Sequence[Any]]]
                 ) -> Awaitable[list[Any]]:
        """Several script calls in one round trip: each one's reply or exception, in order
        (a NoScriptError among them is the caller's to handle). On one Redis they are written
        now, on the auto-pipeline's connection (or with its next write when it has none
        yet), before the caller goes on; on a Cluster they go as one redis-py pipeline once
        awaited."""
        batched = calls[0][0]._batched if calls else None
        if batched is not None:
            return _each(batched.execute_many(
                [lua._evalsha(keys, args) for lua, keys, args in calls]))
        return Lua._pipelined(redis, calls)

    @staticmethod
    async def _pipelined(redis: Redis, calls: Sequence[tuple[Lua, Sequence[Any], Sequence[Any]]]
                         ) -> list[Any]:
        pipe = redis.pipeline(transaction=False)
        for lua, keys, args in calls:
            lua.queue_on(pipe, keys, args)
        return list(await pipe.execute(raise_on_error=False))

    def queue_on(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """A bare EVALSHA on a pipeline, without the SCRIPT EXISTS trip redis-py's Script makes
        before each such pipeline: its caller runs it with raise_on_error=False and, meeting a
        NoScriptError, calls `load` and runs it again."""
        pipe.execute_command(*self._evalsha(keys, args))

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self._script.sha, len(keys), *keys, *args)

    async def load(self) -> None:
        await self._redis.script_load(self._script.script)

    async def call_and_wait(
        self, keys: Sequence[Any], args: Sequence[Any], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """The script, then WAIT for `replicas` to have its writes, in one round trip; returns
        its result and how many replicas confirmed (fewer once `timeout_ms` has passed)."""
        cluster = self._redis if isinstance(self._redis, RedisCluster) else None
        for attempt in (1, 2, 3):
            # On a Cluster, WAIT goes with the script to its keys' master, on the same
            # connection (a WAIT counts the writes of its own connection).
            node: dict[str, Any] = ({"target_nodes": cluster.get_node_from_key(keys[0])}
                                    if cluster else {})
            res, acked = await self._send(keys, args, replicas, timeout_ms, node)
            if attempt < 3 and isinstance(res, NoScriptError):
                await self._redis.script_load(self._script.script)
                continue
            if cluster and attempt < 3 and isinstance(res, MovedError):
                # The slot map was stale (a failover): the script did not run, and the WAIT
                # beside it asked a node that is not its master, so its count (or a replica's
                # refusal) means nothing. Both go again, to the master the MOVED names.
                await cluster.nodes_manager.move_slot(res)
                continue
            if isinstance(res, Exception):
                raise res
            if isinstance(acked, Exception):
                # The script ran, but its writes could not be counted on the replicas: its
                # node was made a replica in between (a failover: "WAIT cannot be used with
                # replica instances"), or the connection went. Unconfirmed, as when the WAIT
                # times out: the caller's 503 says to retry with the same Idempotency-Key.
                return res, 0
            return res, int(acked)
        raise AssertionError("unreachable")

    async def _send(self, keys: Sequence[Any], args: Sequence[Any], replicas: int,
                    timeout_ms: int, node: dict[str, Any]) -> list[Any]:
        # No redirection followed by redis-py on a Cluster: it would send the script again,
        # alone, to the right node and keep the WAIT answered by the wrong one.
        options = {"allow_redirections": False} if node else {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.execute_command(*self._evalsha(keys, args))
                pipe.execute_command("WAIT", replicas, timeout_ms, **node)
                return list(await pipe.execute(raise_on_error=False, **options))
        except (RedisConnectionError, RedisTimeoutError):
            if node:
                # A Cluster client reads the slot map again after a node stopped answering a
                # command, not a pipeline: without this, while only submits come, each would
                # go on to the dead master.
                cast(Any, self._redis)._initialize = True
            raise


@dataclass(frozen=True, slots=True)
class Scripts:
    submit: Lua
    claim: Lua
    ack: Lua
    extend: Lua
    reap: Lua
    cancel: Lua
    status: Lua
    promote: Lua
    complete: Lua
    permit: Lua
    release: Lua
    nudge: Lua
    expire: Lua
    oldest: Lua
    recent: Lua
    sent: Lua
    turn: Lua
    retry: Lua
    requeue: Lua
    revive: Lua
    purge: Lua
    hookclaim: Lua
    hookretry: Lua
    hookdone: Lua
    reserve: Lua
    unreserve: Lua
    confirm: Lua
    budget: Lua

    @classmethod
    def register(cls, redis: Redis) -> Scripts:
        names, batched = cls.__dataclass_fields__, AutoPipeline.of(redis)
        return cls(**{n: Lua(redis, source(n), batched) for n in names})
