"""A blocking pop on a connection held for it: the dispatcher's wake loop pops a marker every
few claims, and a connection taken from the pool and given back for each (the pool checks it
with a read each time) cost that loop most of its CPU."""

from __future__ import annotations

import asyncio
from typing import Any

from hiredis import pack_command
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from app.core.autopipe import connection_closed


class HeldPop:
    """BZPOPMIN of one key at a time, on one connection kept between calls; on a Cluster
    client (which routes by slot) it goes through the client."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        pool = getattr(redis, "connection_pool", None)
        self._pool = pool if isinstance(pool, ConnectionPool) else None
        self._conn: AbstractConnection | None = None
        self._packed: dict[tuple[str, float], bytes] = {}  # the same few commands, again

    async def bzpopmin(self, key: str, timeout_s: float) -> Any:
        """[key, member, score], or None after `timeout_s` with nothing to pop."""
        if self._pool is None:
            return await self._redis.bzpopmin(key, timeout=timeout_s)
        if self._conn is not None and connection_closed(self._conn):
            await self.close()  # closed by Redis while it waited (a restart): not written to
        if self._conn is None:
            self._conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        conn = self._conn
        packed = self._packed.get((key, timeout_s))
        if packed is None:
            command: tuple[Any, ...] = ("BZPOPMIN", key, timeout_s)
            packed = self._packed[key, timeout_s] = pack_command(command)
        try:
            if conn._writer is None:  # the pool lends connections not yet connected
                await conn.connect()
            # Written, not sent through redis-py's send_command (a timeout and a drain each
            # time): a few dozen bytes go at once, and the read below has the timeout.
            conn._writer.write(packed)  # type: ignore[union-attr]
            return await conn.read_response()
        except BaseException:
            # An error or a cancel mid-pop: its reply may still come, so the connection is
            # not used again (a pop that fails without reaching Redis loses nothing either).
            self._conn = None
            await asyncio.shield(self._drop(conn))
            raise

    async def _drop(self, conn: AbstractConnection) -> None:
        await conn.disconnect()
        if self._pool is not None:
            await self._pool.release(conn)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await self._drop(conn)
