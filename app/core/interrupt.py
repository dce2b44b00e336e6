"""Stop what the current task awaits when one of some futures completes, without a task of its
own: `with Interrupt(caller_gone) as why: await call()`, then `why.by` says which ended it.

The shape `asyncio.wait({ensure_future(work), gone}, FIRST_COMPLETED)` costs a task and the
wait's callbacks on every request, for the rare one whose caller leaves; this costs a callback
on each future. It cancels the task it was entered in, as `asyncio.timeout` does, and takes
that cancellation back at the block's end: what is cancelled from elsewhere stays cancelled.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any


class Interrupt:
    def __init__(self, *futures: asyncio.Future[Any]) -> None:
        self._futures = futures
        self._task: asyncio.Task[Any] | None = None
        self._level = 0  # cancellations the task had pending on entry
        self._armed = False
        self.by: asyncio.Future[Any] | None = None  # the future that ended the block

    def __enter__(self) -> Interrupt:
        self._task = asyncio.current_task()
        assert self._task is not None, "an Interrupt is entered in a task"
        self._level = self._task.cancelling()
        self._armed = True
        for fut in self._futures:
            fut.add_done_callback(self._fire)
        return self

    def _fire(self, fut: asyncio.Future[Any]) -> None:
        # A callback scheduled before the block ended may run after it: disarmed, it does
        # nothing (a late cancel would land in whatever the task does next).
        if self._armed and self.by is None:
            self.by = fut
            assert self._task is not None
            self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._armed = False
        for fut in self._futures:
            fut.remove_done_callback(self._fire)
        if self.by is None:
            return False
        assert self._task is not None
        # Ours taken back; swallowed only when nothing else cancelled the task meanwhile.
        return self._task.uncancel() <= self._level and kind is asyncio.CancelledError
