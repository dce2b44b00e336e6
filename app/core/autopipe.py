"""Auto-pipelining: the script calls of concurrent tasks go to Redis together, and without
waiting for each other's replies.

A call through redis-py costs its caller about 50 µs of CPU (a connection from the pool, a
timeout, a write, a read, each with its own event-loop turns); Redis itself spends less on a
submit. Here calls share one connection, their replies read back in order by one task (ioredis
does the same, which is much of BullMQ's lead). A call goes out at the end of its turn of the
event loop, with the others of that turn; while replies are owed, calls wait for the last of
them and go together, unless WRITE_AT are waiting: those go at once, so that Redis runs them
while this process handles the replies it has, rather than the two taking turns. Measured on
this machine with 50 concurrent callers of one script: 50 µs of client CPU per call through
redis-py, 13-16 µs here; with 10 callers of the submit script, 1.75x the calls a second of
one write per round trip.

Semantics are those of single calls on a client that never re-sends (app/redis_url.py): each
caller gets its own reply or error; a reply that is an error (NOSCRIPT, a script error,
LOADING) is that caller's alone; a connection lost or timed out (no reply for the socket
timeout) fails the calls it carried (whether Redis ran them is unknown, as for a single call)
and the calls after them go on another connection. A caller that gave up before its call was
written is left out.

One Redis only (also the master a Sentinel names): a Cluster client routes each call by slot,
and is left to do so.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import deque
from typing import Any

from hiredis import pack_command  # in C: a fraction of redis-py's packing in Python
from redis import __version__ as redis_version
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import BusyLoadingError, DataError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
# Replies redis-py raises as errors; the connection they came on is fine. (A LOADING reply is
# a ConnectionError to redis-py, but it is one command's answer like any other.)
_REPLY_ERRORS = (ResponseError, BusyLoadingError)
_Call = tuple[tuple[Any, ...], "asyncio.Future[Any]"]
# One write carries at most this many calls or about this many bytes (request bodies can be
# large); more waiting go in the writes after it, in order. Nothing is written while the
# transport holds BATCH_BYTES unsent.
BATCH_CALLS, BATCH_BYTES = 512, 1 << 20
# With replies owed, calls are written at once when this many wait, rather than after the
# last owed reply. Measured with 10 callers of a 30 µs script (bench/peers.py enqueue): 1
# adds a read per call to Redis's CPU (+25%); only after the owed replies, Redis and this
# process take turns (-30% calls/s).
WRITE_AT = 4
# With nothing owed and nothing waiting, the reader keeps its connection this long for the
# next call (a dispatcher's next acks come a fraction of a millisecond after their claim's
# reply): a connection taken from the pool and given back for every round trip was a tenth of
# a dispatcher's CPU. Short, so a process that goes quiet gives it back soon.
IDLE_S = 0.05


#: The private parts of redis-py's asyncio connection read here, slots of its class (redis-py
#: 8.1; pyproject.toml pins it). A release that renames one turns this module off.
PRIVATE = ("_reader", "_writer")
#: The methods called, with the keyword arguments given to them.
METHODS = {"read_response": ("timeout", "disconnect_on_error"), "disconnect": ("nowait",)}


def unsupported(pool: ConnectionPool) -> list[str]:
    """What this module reads of a connection that the pool's connection class does not
    have (none: auto-pipelining works). Read from the class (redis-py declares these in
    __slots__), never from a connection made for the purpose: building one has effects."""
    cls = pool.connection_class
    missing = [name for name in (*PRIVATE, "socket_timeout") if not hasattr(cls, name)]
    for name, keywords in METHODS.items():
        method = getattr(cls, name, None)
        params = inspect.signature(method).parameters if callable(method) else {}
        missing += [f"{name}({k}=)" for k in keywords if k not in params]
    return missing


class PipelineClosed(RedisConnectionError):
    """The auto-pipeline was stopped (its task cancelled: the process is shutting down)."""


class AutoPipeline:
    """Commands whose replies need no parsing beyond the protocol's (EVALSHA): redis-py's
    response callbacks are not applied. Never a blocking or pub/sub command: every call
    behind it would wait for its reply."""

    __slots__ = ("_conn", "_flushing", "_idle", "_pool", "_sent", "_task", "_waiting")

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._waiting: list[_Call] = []  # not written yet
        self._sent: deque[asyncio.Future[Any]] = deque()  # written, reply not read yet
        self._conn: AbstractConnection | None = None  # while the task below holds one
        self._task: asyncio.Task[None] | None = None  # takes a connection, reads replies
        self._flushing = False  # a write is due at the end of this turn
        self._idle: asyncio.Future[None] | None = None  # the reader waits on it for a write

    @classmethod
    def of(cls, redis: Redis) -> AutoPipeline | None:
        """One for this client's pool, or None for a Cluster client or a redis-py whose
        connections are not what this module reads (then every call is a plain one)."""
        pool = getattr(redis, "connection_pool", None)
        if not isinstance(pool, ConnectionPool):
            return None
        missing = unsupported(pool)
        if missing:
            log.warning("auto-pipelining off, plain Redis calls instead: redis-py %s lacks %s",
                        redis_version, ", ".join(missing))
            return None
        return cls(pool)

    def execute(self, *args: Any) -> asyncio.Future[Any]:
        """Send `args` as one command (when: see the module's docstring); its reply (or
        error) resolves the returned future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._task is not None and self._task.get_loop() is not loop:
            # Left by a loop that closed without cancelling it: its calls died with it.
            self._task, self._conn, self._waiting, self._flushing = None, None, [], False
            self._sent.clear()
        self._waiting.append((args, fut))
        if self._task is None:
            self._start(loop)
        elif self._conn is not None:
            if len(self._waiting) >= WRITE_AT:
                self._write(self._conn)
            elif not self._sent and not self._flushing:
                # After the callbacks already due this turn: their calls join the write.
                # (With replies owed, the reader writes the calls once the last is read.)
                self._flushing = True
                loop.call_soon(self._flush)
        return fut

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The task that takes a connection, writes what is waiting by then and reads the
        replies."""
        self._task = task = loop.create_task(self._run())
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A task cancelled before it ran (on shutdown) never reached its `finally`: its calls
        end here, or their callers would wait forever."""
        if self._task is task:
            self._task, self._conn = None, None
            self._end(PipelineClosed("the auto-pipeline was stopped"), waiting=True)

    def execute_many(self, calls: list[tuple[Any, ...]]) -> list[asyncio.Future[Any]]:
        """Several commands, as `execute` each, written together now if a connection is held
        (they are a group already: nothing is gained by waiting for the turn's end)."""
        futs = [self.execute(*args) for args in calls]
        if self._conn is not None and self._waiting:
            self._write(self._conn)
        return futs

    def execute_now(self, *args: Any) -> tuple[asyncio.Future[Any], bool]:
        """`execute`, written now if a connection is held: True when it was (its bytes are
        in the socket, ahead of anything this process writes anywhere after)."""
        (fut,) = self.execute_many([args])
        return fut, not any(f is fut for _, f in self._waiting)

    def _flush(self) -> None:
        self._flushing = False
        if self._conn is not None:
            self._write(self._conn)

    def _write(self, conn: AbstractConnection) -> bool:
        """Write the calls waiting, packed, in writes of at most BATCH_CALLS or about
        BATCH_BYTES, while the transport holds less than BATCH_BYTES unsent; False if some
        wait still and none went. A call whose arguments Redis cannot take fails alone,
        here. Never raises: a connection lost shows in the read of its replies."""
        writer = conn._writer  # redis-py's stream: a write is queued, not awaited (no drain)
        wrote = False
        while self._waiting:
            if connection_closed(conn):
                break  # closed under us (the client's aclose, Redis gone): the read fails
            if writer.transport.get_write_buffer_size() >= BATCH_BYTES:  # type: ignore[union-attr]
                break  # Redis is slow to read large calls: not in memory twice
            packed: list[bytes] = []
            futs: list[asyncio.Future[Any]] = []
            size = taken = 0
            for args, fut in self._waiting:
                if len(packed) >= BATCH_CALLS or size >= BATCH_BYTES:
                    break
                taken += 1
                if fut.done():  # its caller gave up before it was sent
                    continue
                try:
                    command = pack_command(args)
                except (TypeError, ValueError, DataError) as exc:  # e.g. None, a lone surrogate
                    fut.set_exception(DataError(f"cannot send this command: {exc}"))
                    continue
                packed.append(command)
                futs.append(fut)
                size += len(command)
            del self._waiting[:taken]
            if packed:
                writer.write(b"".join(packed))  # type: ignore[union-attr]
                self._sent.extend(futs)
                wrote = True
        idle, self._idle = self._idle, None
        if idle is not None and not idle.done():
            idle.set_result(None)  # the reader, to read the replies (or find it closed)
        return wrote or not self._waiting

    async def _run(self) -> None:
        conn: AbstractConnection | None = None
        dog: _Watchdog | None = None
        try:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
            self._conn = conn
            if conn.socket_timeout:
                dog = _Watchdog(conn.socket_timeout, self._sent)
            await self._serve(conn, dog)
        except BaseException as exc:
            self._conn = None
            if dog is not None:
                dog.stop()  # not to cancel what follows
                if dog.timed_out(exc):
                    exc = RedisTimeoutError(f"no reply from Redis in {dog.timeout_s} s")
            await self._fail(exc, conn)
            if not isinstance(exc, Exception):
                raise
        finally:
            if dog is not None:
                dog.stop()
            self._conn = None
            if conn is not None:
                await self._pool.release(conn)
            # Cleared only now: a call made during the release joins the waiting ones,
            # rather than starting a second reader beside the one started below.
            self._task = None
            if self._waiting:
                self._start(asyncio.get_running_loop())

    async def _serve(self, conn: AbstractConnection, dog: _Watchdog | None) -> None:
        """Write what waits and read the replies owed, in order, until none are owed or
        waiting for a whole turn."""
        lingered = False
        while True:
            if not self._sent:
                if self._waiting:  # calls that waited behind the replies just read
                    if not self._write(conn):  # the transport is full, or closed
                        if connection_closed(conn):
                            raise RedisConnectionError("the Redis connection was closed")
                        await conn._writer.drain()  # type: ignore[union-attr]
                    continue
                if lingered:
                    if await self._wait_idle():
                        continue
                    return
                # The callers of the replies just read run in the next turn, and most call
                # again: kept, the connection takes their calls at once (WRITE_AT) rather
                # than from a new task one turn later while Redis waits.
                lingered = True
                await asyncio.sleep(0)
                continue
            lingered = False
            try:
                # Not disconnected by redis-py on an error: a LOADING reply would be one. No
                # timeout of redis-py's: the watchdog's covers every read.
                reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False)
            except _REPLY_ERRORS as exc:  # this command's error; the connection is fine
                reply = exc
            if dog is not None:
                dog.progress += 1
            fut = self._sent.popleft()
            if fut.done():  # its caller gave up meanwhile
                continue
            if isinstance(reply, _REPLY_ERRORS):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    async def _wait_idle(self) -> bool:
        """Hold the connection up to IDLE_S for a call (written by `_write`, which wakes
        this); False if none came."""
        loop = asyncio.get_running_loop()
        self._idle = idle = loop.create_future()
        timer = loop.call_later(IDLE_S, _settle, idle)
        try:
            await idle
        finally:
            timer.cancel()
            if self._idle is idle:
                self._idle = None
        return bool(self._sent or self._waiting)

    async def _fail(self, exc: BaseException, conn: AbstractConnection | None) -> None:
        """No connection (Redis down), or it was lost or timed out, or this task was cancelled
        (shutdown): every call written on it and not answered ends, as do those waiting when
        there was no connection or on shutdown; otherwise they go on another connection."""
        if conn is not None:
            await conn.disconnect(nowait=True)  # replies owed on it are never read
        failed = exc if isinstance(exc, Exception) else PipelineClosed(
            "the Redis connection was closed: shutting down")
        self._end(failed, waiting=conn is None or failed is not exc)

    def _end(self, exc: Exception, waiting: bool) -> None:
        """Fail the calls written and not answered, and with `waiting` those not written."""
        ended = list(self._sent)
        self._sent.clear()
        if waiting:
            ended += [fut for _, fut in self._waiting]
            self._waiting = []
        for fut in ended:
            if not fut.done():
                fut.set_exception(exc)


def connection_closed(conn: AbstractConnection) -> bool:
    """Closed, or closed by Redis (a connection held idle may be: a restart, CLIENT KILL);
    what the pool checks before it lends a connection."""
    writer, reader = conn._writer, conn._reader
    return (writer is None or writer.transport.is_closing() or reader is None
            or reader.at_eof())


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Watchdog:
    """The read timeout of a connection carrying many replies. redis-py's (a timeout context
    around each read) cost a third of a call's client CPU here; this is one timer every half
    timeout: a reader that owes replies and read none over two checks in a row (between one
    and one and a half timeouts) is cancelled, and its calls fail as on redis-py's timeout."""

    __slots__ = ("_half", "_handle", "_quiet", "_seen", "_sent", "_task", "fired", "progress",
                 "timeout_s")

    def __init__(self, timeout_s: float, sent: deque[asyncio.Future[Any]]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task, self._sent, self.timeout_s, self._half = task, sent, timeout_s, timeout_s / 2
        self.progress = self._seen = self._quiet = 0  # progress: replies read, by the reader
        self.fired = False
        self._handle = task.get_loop().call_later(self._half, self._check)

    def _check(self) -> None:
        if self.progress != self._seen or not self._sent:
            self._seen, self._quiet = self.progress, 0
        else:
            self._quiet += 1
            if self._quiet >= 2:
                self.fired = True
                self._task.cancel()
                return
        self._handle = self._task.get_loop().call_later(self._half, self._check)

    def timed_out(self, exc: BaseException) -> bool:
        """Whether `exc` is this watchdog's cancellation alone (not also a shutdown's)."""
        return (self.fired and isinstance(exc, asyncio.CancelledError)
                and self._task.uncancel() == 0)

    def stop(self) -> None:
        self._handle.cancel()

