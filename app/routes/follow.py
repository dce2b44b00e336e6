"""Follow a task: `GET /api/v1/tasks/{task_id}/events`, server-sent events (docs/api.md).

`event: status` with the status JSON at once and again on every change; the stream ends after
a terminal status. Woken by the status events of app/queue/events.py; through a Redis outage
it keeps the connection open (comment lines), reads again once Redis answers, and so still
sends the terminal status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError

from app.auth import api_key, runtime_of
from app.core.keys import endpoint_of
from app.errors import ApiError
from app.models import TaskView
from app.queue.events import TaskEvents
from app.routes.tasks import ERRORS, _checked

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
    read = partial(rt.queue.status, caller.user_id, tid, rt.registry.get(endpoint_of(tid)))
    await read()  # unknown, not this caller's, or unavailable: a JSON error, not a stream
    return StreamingResponse(_stream(rt.events, tid, read), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(
    events: TaskEvents, task_id: str, read: Callable[[], Awaitable[TaskView]]
) -> AsyncIterator[str]:
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
                yield f"event: status\ndata: {json.dumps(view.model_dump(mode='json'))}\n\n"
            if view.task_status.finished:
                return
            if not await w.changed(KEEPALIVE_S):
                # Read again at each keep-alive too: a wake lost anyhow costs at most this long.
                yield ": keepalive\n\n"
