"""Follow a task: `GET /api/v1/tasks/{task_id}/events`, server-sent events (docs/api.md).

`event: status` with the status JSON at once and again on every change; the stream ends after
a terminal status. Woken by the status events of app/queue/events.py; through a Redis outage
it keeps the connection open (comment lines), reads again once Redis answers, and so still
sends the terminal status. A status carrying a large inline result is a large read: sent within
one of the key's read slots (app/sending.py) and the process's memory budget for large answers
(app/answer_cache.py), or, neither making room within the wait, replaced by `event: error` with
`too_many_reads` and the end of the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, aclosing
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError

from app.auth import api_key, runtime_of
from app.core.keys import endpoint_of
from app.errors import ApiError
from app.models import TaskView
from app.queue.events import TaskEvents
from app.routes.large import LARGE, pieces, pinned_answer
from app.routes.tasks import ERRORS, _checked
from app.sending import ClosingStream, HeldStream, ReadSlots

router = APIRouter(prefix="/api/v1", tags=["tasks"])
KEEPALIVE_S = 15.0  # a comment line this often: proxies keep the stream, clients see it live
RETRY_S = 1.0  # while Redis (or the database) does not answer


@router.get("/tasks/{task_id}/events", responses={
    **ERRORS, 200: {"description": "`event: status` with the status JSON, on every change",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}},
    response_class=StreamingResponse)
async def follow_task(request: Request, task_id: str) -> StreamingResponse:
    """Server-sent events of a task's status until it ends."""
    caller, rt = api_key(request), runtime_of(request)
    tid = _checked(task_id)
    endpoint = rt.registry.get(endpoint_of(tid))
    read = partial(rt.queue.status, caller.user_id, tid, endpoint, result_limit=LARGE)
    # Unknown, not this caller's, or unavailable: a JSON error, not a stream.
    first = await read()
    whole = partial(pinned_answer, rt, caller.user_id, endpoint)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if not first.result_left_out:
        # One that ends so later takes its slot when its final event is due (_large_event).
        stream = _stream(rt.events, tid, read, whole, (rt.read_slots, caller.id))
        return ClosingStream(stream, media_type="text/event-stream", headers=headers)
    # An ended task with megabytes inline: a large read, as its status is (its slot taken
    # here, where a 429 can still be answered, and held by the stream).
    await rt.read_slots.take(caller.id)
    return HeldStream(rt.read_slots, caller.id, _stream(rt.events, tid, read, whole, None),
                      media_type="text/event-stream", headers=headers)


async def _stream(
    events: TaskEvents, task_id: str, read: Callable[[], Awaitable[TaskView]],
    whole: Callable[[TaskView], AbstractAsyncContextManager[bytes]],
    slot: tuple[ReadSlots, str] | None,
) -> AsyncIterator[str | bytes | memoryview]:
    """`slot`: the key's read slots, for a large final event; None when one is held already."""
    # The watch is registered before each read it guards, so a change is never missed:
    # at worst it is read twice.
    with events.watch(task_id) as w:
        last = None
        while not w.closed:
            try:
                view = await read()
            except (RedisError, OSError):
                view = None
            except ApiError as exc:
                if exc.status != 503:
                    return  # gone meanwhile (delivered to another reader and let go)
                view = None
            if view is None:
                yield ": unavailable, retrying\n\n"
                await w.changed(RETRY_S)
                continue
            if view.task_status != last:
                last = view.task_status
                if view.result_left_out:  # the kept encoding, piece by piece (large.py)
                    async with aclosing(_large_event(view, whole, slot)) as event:
                        async for piece in event:  # closed at once, its slot given back
                            yield piece
                else:
                    yield f"event: status\ndata: {json.dumps(view.model_dump(mode='json'))}\n\n"
            if view.task_status.finished:
                return
            if not await w.changed(KEEPALIVE_S):
                # Read again at each keep-alive too: a wake lost anyhow costs at most this long.
                yield ": keepalive\n\n"


async def _large_event(view: TaskView,
                       whole: Callable[[TaskView], AbstractAsyncContextManager[bytes]],
                       slot: tuple[ReadSlots, str] | None
                       ) -> AsyncGenerator[bytes | memoryview, None]:
    """`event: status` with a large result, within a read slot (taken here unless `slot` is
    None) and the process's memory budget (the answer pinned by `whole`); no room within the
    wait: `event: error` with too_many_reads, which ends the stream, as a status read would
    have been answered 429 (the client reads the task again later, its status or /result)."""
    if slot is not None:
        try:
            await slot[0].take(slot[1])
        except ApiError as exc:
            yield _refused(view, exc)
            return
    try:
        async with AsyncExitStack() as stack:
            try:
                body = await stack.enter_async_context(whole(view))
            except ApiError as exc:
                if exc.status != 429:
                    raise
                yield _refused(view, exc)
                return
            yield b"event: status\ndata: "
            async for piece in pieces(body):
                yield piece
            yield b"\n\n"
    finally:
        if slot is not None:
            slot[0].give(slot[1])


def _refused(view: TaskView, exc: ApiError) -> bytes:
    error = {"code": exc.code, "message": exc.message, "task_status": view.task_status.value,
             "retry_after": 1}
    return f"event: error\ndata: {json.dumps({'error': error})}\n\n".encode()
