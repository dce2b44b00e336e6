"""Waiting for a task's status to change, woken by Redis pub/sub instead of polling.

Every script that changes a status publishes the ids it changed on the endpoint's channel
(`Keys.events`, lua/includes/events.lua). One listener per process holds one pub/sub
connection, subscribed to the channels of the endpoints somebody here waits on, and wakes
the `Watch`es of the ids it hears about. A waiter re-reads the status when woken, so a
message only has to say "look again". Messages published while the listener is not
subscribed are lost; so whenever Redis confirms a subscription (the first one, or again after
a reconnect) every watch of that endpoint is woken and re-reads: no change goes unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.core.keys import Keys, endpoint_of
from app.models import TaskView

log = logging.getLogger(__name__)

LINGER_S = 60.0  # a channel nobody waits on stays subscribed this long (no churn per request)
READ_S = 30.0  # longest quiet read; each read checks the connection's health (a PING / 30 s)
RETRY_MAX_S = 2.0
STOP_S = 1.0  # longest wait for the listener at stop


class Watch:
    """Interest in one task: `changed` returns once its status may have changed."""

    __slots__ = ("_event", "closed", "task_id")

    def __init__(self, task_id: str) -> None:
        self.task_id, self.closed = task_id, False
        self._event = asyncio.Event()

    def wake(self) -> None:
        self._event.set()

    async def changed(self, within_s: float) -> bool:
        """True when woken (the status may have changed: read it again), False on timeout.
        A wake that came while the caller was reading is kept for the next call."""
        try:
            await asyncio.wait_for(self._event.wait(), max(0.0, within_s))
        except TimeoutError:
            return False
        self._event.clear()
        return True


class TaskEvents:
    """The process's listener; started with the first watch, so only API processes run it."""

    def __init__(self, redis: Redis, keys: Keys, linger_s: float = LINGER_S) -> None:
        self.redis, self.keys, self.linger_s = redis, keys, linger_s
        self._watches: dict[str, set[Watch]] = {}  # task id -> its watches
        self._users: dict[str, int] = {}  # channel -> watches of its endpoint
        self._idle_since: dict[str, float] = {}  # channel nobody watches -> since when
        self._endpoints: dict[str, str] = {}  # channel -> its endpoint
        self._requested: set[str] = set()  # SUBSCRIBE sent on the current connection
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._closed = False

    @contextlib.contextmanager
    def watch(self, task_id: str) -> Iterator[Watch]:
        """Register before reading the status, so no change after the read is missed."""
        w = Watch(task_id)
        ch = self.keys.events(endpoint_of(task_id))
        self._endpoints[ch] = endpoint_of(task_id)
        self._watches.setdefault(task_id, set()).add(w)
        self._users[ch] = self._users.get(ch, 0) + 1
        self._idle_since.pop(ch, None)
        w.closed = self._closed
        self._ensure(ch)
        try:
            yield w
        finally:
            watches = self._watches.get(task_id)
            if watches is not None:
                watches.discard(w)
                if not watches:
                    del self._watches[task_id]
            self._users[ch] -= 1
            if not self._users[ch]:
                del self._users[ch]
                self._idle_since[ch] = time.monotonic()

    def _ensure(self, channel: str) -> None:
        if self._closed:
            return
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="task-events")
        elif self._pubsub is not None and channel not in self._requested:
            self._requested.add(channel)
            asyncio.create_task(self._subscribe(self._pubsub, [channel]))  # noqa: RUF006

    async def _subscribe(self, pubsub: Any, channels: list[str]) -> None:
        if pubsub is not self._pubsub:
            return  # that connection is gone; its successor subscribes to every channel wanted
        # A broken connection: the listener sees it, reconnects and subscribes again.
        with contextlib.suppress(RedisError, OSError):
            await pubsub.subscribe(*channels)

    async def _listen(self) -> None:
        delay = 0.1
        while not self._closed and self._wanted():
            cutoff = time.monotonic() - self.linger_s
            for ch in [ch for ch, since in self._idle_since.items() if since <= cutoff]:
                del self._idle_since[ch]  # nobody waits: no need to reconnect for it
            if not self._wanted():
                break
            try:
                async with self.redis.pubsub() as pubsub:
                    self._requested = set(self._wanted())
                    await pubsub.subscribe(*self._requested)
                    self._pubsub, delay = pubsub, 0.1
                    # Watches that came while that SUBSCRIBE was connecting found no
                    # connection to subscribe on (_ensure): their channels go now.
                    late = self._wanted() - self._requested
                    if late:
                        self._requested |= late
                        await pubsub.subscribe(*late)
                    await self._read(pubsub)
            except (RedisError, OSError) as exc:
                log.warning("task events: redis error %s; reconnecting", exc)
            finally:
                self._pubsub, self._requested = None, set()
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    def _wanted(self) -> set[str]:
        return set(self._users) | set(self._idle_since)

    async def _read(self, pubsub: Any) -> None:
        next_sweep = time.monotonic() + self.linger_s
        while self._requested and not self._closed:
            msg = await pubsub.get_message(timeout=READ_S)
            if msg is not None:
                self._dispatch(msg)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + self.linger_s
                await self._drop_idle(pubsub)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind, data = msg["type"], msg["data"]
        if kind == "message" and isinstance(data, str):
            for task_id in data.split(" "):
                for w in self._watches.get(task_id, ()):
                    w.wake()
        elif kind == "subscribe":
            # Anything published before this confirmation was not heard: look again.
            endpoint = self._endpoints.get(str(msg["channel"]))
            for task_id, watches in self._watches.items():
                if endpoint_of(task_id) == endpoint:
                    for w in watches:
                        w.wake()

    async def _drop_idle(self, pubsub: Any) -> None:
        cutoff = time.monotonic() - self.linger_s
        idle = [ch for ch, since in self._idle_since.items() if since <= cutoff]
        if not idle:
            return
        for ch in idle:
            del self._idle_since[ch]
            self._requested.discard(ch)
        await pubsub.unsubscribe(*idle)
        # A watch that came while UNSUBSCRIBE was on its way saw the channel still requested.
        back = [ch for ch in idle if ch in self._users and ch not in self._requested]
        if back:
            self._requested.update(back)
            await pubsub.subscribe(*back)

    async def stop(self) -> None:
        """Stop listening; every watch is woken and marked closed, so streams end."""
        self._closed = True
        for watches in self._watches.values():
            for w in watches:
                w.closed = True
                w.wake()
        if self._listener is not None:
            # Bounded: redis-py's PubSub may swallow the cancellation of a read on a connection
            # made after an outage and read on (30 s, READ_S); stopping does not wait for it.
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=STOP_S)


async def next_change(
    events: TaskEvents, task_id: str, read: Callable[[], Awaitable[TaskView]], wait_s: float
) -> TaskView:
    """The task once its status differs from now, or as it is after `wait_s` (`?wait=`)."""
    deadline = time.monotonic() + wait_s
    with events.watch(task_id) as w:
        view = await read()
        first = view.task_status
        while view.task_status == first and not first.finished and not w.closed:
            if not await w.changed(deadline - time.monotonic()):
                break
            view = await read()
    return view
