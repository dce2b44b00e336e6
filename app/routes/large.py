"""Status answers that carry a large inline result (QGW_RESULT_INLINE_BYTES raised to
megabytes): read as large reads, like /result's from the store.

The status call leaves a result longer than LARGE in Redis (status-6.lua, ARGV[5]); such an
answer takes one of the key's read slots (QGW_MAX_LARGE_READS_PER_KEY, app/sending.py), is
encoded once per task and process (app/answer_cache.py) and is sent in CHUNK pieces, so each
write meets the send deadline on its own and a reader that stops reading pins a piece and the
socket's buffers, never a copy of the answer. `/result` of such a task is a large read too: its
decoded bytes are kept the same way (large_result). Each large read pins the answer it sends
within the process's memory budget (AnswerCache.pin) until its answer has ended: beyond the
budget, 429 too_many_reads as beyond the key's slots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

from fastapi.responses import JSONResponse, Response

from app.endpoints import EndpointConfig
from app.errors import ApiError
from app.models import TaskView
from app.queue.answers import ResultMeta, body_of
from app.runtime import Runtime
from app.sending import HeldStream
from app.store import ApiKey

#: A status read leaves a result longer than this (bytes) out, as a large read. Above what
#: the default QGW_RESULT_INLINE_BYTES keeps inline (256 KiB, its base64 a third more), so a
#: gateway with the defaults never takes this path.
LARGE = 1 << 20
#: What one write of a large answer sends.
CHUNK = 256 << 10
#: While an answer is built, its copies on the way (the reply from Redis, the JSON, the bytes)
#: take about this many times its size: what its pin holds until the size is known.
FILLING = 2


async def _in_slot(rt: Runtime, caller: ApiKey, build: Callable[[], Awaitable[bytes]]
                   ) -> bytes:
    """`build()`'s answer within one of the caller's read slots, which the HeldStream sending
    it gives back once the answer has ended (here at once if it cannot be built)."""
    await rt.read_slots.take(caller.id)
    try:
        return await build()
    except BaseException:
        rt.read_slots.give(caller.id)
        raise


async def large_answer(rt: Runtime, caller: ApiKey, endpoint: EndpointConfig | None,
                       view: TaskView) -> Response:
    """`view` (read with LARGE, its result left out) answered whole, streamed, within a slot."""
    body = await _in_slot(rt, caller, partial(encoded, rt, caller.user_id, endpoint, view))
    return HeldStream(rt.read_slots, caller.id, pieces(body), 200, media_type="application/json",
                      headers={"Content-Length": str(len(body))},
                      pinned=(rt.answers, view.task_id))


@asynccontextmanager
async def pinned_answer(rt: Runtime, user_id: int, endpoint: EndpointConfig | None,
                        view: TaskView) -> AsyncIterator[bytes]:
    """`encoded`'s bytes, pinned while the block runs (an /events stream's final event)."""
    body = await encoded(rt, user_id, endpoint, view)
    try:
        yield body
    finally:
        rt.answers.unpin(view.task_id)


async def encoded(rt: Runtime, user_id: int, endpoint: EndpointConfig | None,
                  view: TaskView) -> bytes:
    """The status answer of `view`'s task with its result, as JSON bytes: kept ones when the
    task is as `view` saw it (the caller's own status call checked it is theirs). Pinned
    under the task's id (429 without room): the caller unpins it once sent."""
    version = _version(view)
    need = FILLING * (view.result_bytes or LARGE) + CHUNK  # base64 and JSON within FILLING
    return await _pinned(rt, view.task_id, version, need, lambda: _encode(rt, user_id, endpoint,
                                                                          view, version))


async def _encode(rt: Runtime, user_id: int, endpoint: EndpointConfig | None, view: TaskView,
                  version: str) -> bytes:
    async with rt.answers.filling(view.task_id):
        if (body := rt.answers.get(view.task_id, version)) is not None:
            return body  # another read built it meanwhile
        whole = await rt.queue.status(user_id, view.task_id, endpoint)
        body = bytes(JSONResponse(whole.model_dump(mode="json")).body)
        if whole.task_status.finished and _version(whole) == version:
            rt.answers.put(view.task_id, version, body)
        return body


async def large_result(rt: Runtime, caller: ApiKey, task_id: str, fields: dict[str, str],
                       span: tuple[int, int], code: int, headers: dict[str, str], ctype: str
                       ) -> Response:
    """`/result` of an inline result over LARGE (`fields` read without it): its decoded
    bytes, kept once per task and process like a status answer, streamed within a slot;
    `span` the range asked for (start, end exclusive)."""
    body = await _in_slot(rt, caller, partial(decoded, rt, caller.user_id, task_id, fields))
    start, end = span
    headers = {**headers, "Content-Length": str(end - start)}
    return HeldStream(rt.read_slots, caller.id, pieces(memoryview(body)[start:end]), code,
                      headers=headers, media_type=ctype, pinned=(rt.answers, _kept(task_id)))


async def decoded(rt: Runtime, user_id: int, task_id: str, fields: dict[str, str]) -> bytes:
    """The inline result's bytes as the upstream sent them (base64 decoded), kept apart from
    the task's status answer; read whole from Redis (or SQL) once per task and process.
    Pinned like `encoded`'s, under _kept(task_id)."""
    version = _fields_version(fields)
    stored = int(fields.get("result_omitted") or 0) or len(fields.get("result") or "")
    need = FILLING * (stored or LARGE)  # the stored text and its decoded bytes
    return await _pinned(rt, _kept(task_id), version, need,
                         lambda: _decode(rt, user_id, task_id, version))


async def _pinned(rt: Runtime, key: str, version: str, need: int,
                  fill: Callable[[], Awaitable[bytes]]) -> bytes:
    """The answer kept under `key` for `version`, else `fill`'s; pinned for the caller: the
    kept one's bytes, or `need` until the filled one's size is known."""
    answers = rt.answers
    kept = answers.get(key, version)
    await answers.pin(key, len(kept) if kept is not None else need)
    try:
        body = answers.get(key, version) or await fill()
    except BaseException:
        answers.unpin(key)
        raise
    answers.settle(key, len(body))
    return body


def _kept(task_id: str) -> str:
    """Where a task's decoded result is kept, apart from its status answer."""
    return f"{task_id} result"


async def _decode(rt: Runtime, user_id: int, task_id: str, version: str) -> bytes:
    kept = _kept(task_id)
    async with rt.answers.filling(kept):
        if (body := rt.answers.get(kept, version)) is not None:
            return body
        whole, _, _ = await rt.queue.fields(user_id, task_id)
        if _fields_version(whole) != version or "result" not in whole:
            # Retried or let go between the two reads: what was checked is not what is here.
            status = whole.get("status", "")
            raise ApiError(409, "no_result", f"task {task_id!r} changed while read "
                           f"(now {status}); ask again", task_status=status)
        body = body_of(whole["result"], ResultMeta.loads(whole.get("result_meta")))
        rt.answers.put(kept, version, body)
        return body


async def pieces(body: bytes | memoryview, size: int = CHUNK) -> AsyncIterator[memoryview]:
    """`body` piece by piece; each one after a turn of the event loop: a reader that takes
    everything at once (a socket buffer never full) would otherwise hold the loop for the
    whole answer, other users' requests waiting behind it."""
    view = memoryview(body)
    for at in range(0, len(body), size):
        await asyncio.sleep(0)
        yield view[at:at + size]


def _fields_version(f: dict[str, str]) -> str:
    """_version's figures from a task's fields, its result left out or not."""
    return " ".join(f.get(name) or "" for name in ("status", "ended_at", "attempts",
                                                    "result_meta"))


def _version(view: TaskView) -> str:
    """What a finished task's answer changes with (an operator's retry, a late ack)."""
    return f"{view.task_status.value} {view.ended_at} {view.attempts} {view.result_bytes}"
