"""`GET /api/v1/tasks/{task_id}/result`: a finished call's answer byte for byte (docs/api.md).

Served with the upstream's Content-Type (Content-Disposition, ETag), `X-Queue-Result-Status`
and single `Range` requests (206; under an `If-Range` that names another ETag or a date, the
whole answer). A body in the result store is streamed from it, never read
whole; `?redirect=1` on an S3 store answers 302 to a presigned URL instead.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.auth import api_key, runtime_of
from app.core.clock import queue_time
from app.core.keys import endpoint_of
from app.errors import ApiError
from app.queue.answers import EXTERNAL, ResultMeta, body_of
from app.queue.objects import (
    MIN_SIGNED_S,
    SIGNED_MARGIN_S,
    SIGNED_S,
    ObjectStore,
    StoreUnavailable,
)
from app.routes.large import LARGE, large_result
from app.routes.tasks import ERRORS, _checked
from app.runtime import Runtime
from app.sending import HeldStream

router = APIRouter(prefix="/api/v1", tags=["tasks"])
RANGE = re.compile(r"^bytes[ \t]*=[ \t]*(\d*)[ \t]*-[ \t]*(\d*)$", re.IGNORECASE | re.ASCII)
#: The upstream's bytes are served from our origin: a browser must not sniff them into
#: something else, nor run a script in them with our origin's rights (cookies, storage).
CONFINED = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"}
#: Types a browser would render as a document (scripts included): downloaded instead, unless
#: the upstream said how to show them (its own Content-Disposition).
ACTIVE_TYPES = frozenset({"text/html", "image/svg+xml", "application/xhtml+xml", "text/xml"})
RANGE_MAX_CHARS = 100  # a longer Range header is ignored (the whole body is served)


@router.get("/tasks/{task_id}/result", responses={
    **ERRORS, 200: {"description": "the answer's bytes, with its Content-Type",
                    "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                         "format": "binary"}}}},
    206: {"description": "the range asked for"}, 302: {"description": "to a presigned URL"},
    416: {"description": "a range outside the body"}}, response_class=Response)
async def task_result(
    request: Request, task_id: str,
    redirect: Annotated[bool, Query(description="S3 store: 302 to a presigned URL")] = False,
) -> Response:
    """The finished call's answer as the upstream sent it."""
    caller, rt = api_key(request), runtime_of(request)
    tid = _checked(task_id)
    # A result over LARGE inline is left in Redis here (its size instead): a large read,
    # taken below within a slot, not copied out per request.
    fields, _, _ = await rt.queue.fields(caller.user_id, tid, result_limit=LARGE)
    status = fields.get("status", "")
    meta = ResultMeta.loads(fields.get("result_meta"))
    text, omitted = fields.get("result"), fields.get("result_omitted")
    if status not in ("completed", "failed") or (meta is None and text is None
                                                  and omitted is None):
        raise ApiError(409, "no_result", f"task {tid!r} is {status} and has no result",
                       task_status=status)
    size = meta.size if meta else (int(omitted) if omitted is not None
                                   else len((text or "").encode()))
    headers = {"X-Queue-Result-Status": fields.get("result_status_code") or "",
               "Accept-Ranges": "bytes", "Cache-Control": "private, no-store", **CONFINED}
    if meta is not None:
        headers.update({k: v for k, v in (("Content-Disposition", meta.disposition),
                                          ("ETag", meta.etag),
                                          ("Content-Encoding", meta.coding)) if v})
    ctype = (meta.content_type if meta else None) or (
        "text/plain; charset=utf-8" if meta is None else "application/octet-stream")
    if "Content-Disposition" not in headers and _active(ctype):
        headers["Content-Disposition"] = "attachment"
    asked = request.headers.get("range")
    if asked and not _same_answer(request.headers.get("if-range"), headers.get("ETag")):
        asked = None  # a resumed download of another answer: the whole of this one
    try:
        span = _range(asked, size)
    except _Unsatisfiable:
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    start, end = span if span else (0, size)
    code = 206 if span else 200
    if span:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    if (meta is None or meta.encoding != EXTERNAL) and omitted is not None:
        return await large_result(rt, caller, tid, fields, (start, end), code, headers, ctype)
    if meta is None or meta.encoding != EXTERNAL:
        body = body_of(text, meta)[start:end]
        return Response(body, code, headers=headers, media_type=ctype)
    objects = rt.objects
    assert meta.ref is not None
    if redirect and objects.s3 and (valid_s := await _signable_s(rt, tid, meta.ref)):
        url = await objects.sign(meta.ref, valid_s)
        return Response(status_code=302, headers={"Location": url or "",
                                                  "Cache-Control": "no-store"})
    # Without `redirect`, or too close to the object's deletion to hand out a link: the
    # bytes go from here.
    await rt.read_slots.take(caller.id)  # given back once the answer has ended (HeldStream)
    try:
        chunks = await _read(objects, tid, status, meta.ref, start, end)
    except BaseException:
        rt.read_slots.give(caller.id)
        raise
    headers["Content-Length"] = str(end - start)
    return HeldStream(rt.read_slots, caller.id, chunks, code, headers=headers, media_type=ctype)


async def _read(objects: ObjectStore, tid: str, status: str, ref: str, start: int, end: int
                ) -> AsyncIterator[bytes]:
    """The object's range as a stream; the store's failures as the API's errors."""
    try:
        return await objects.read(ref, start, end) if end > start else _empty()
    except FileNotFoundError:
        raise ApiError(404, "result_gone", f"the result of task {tid!r} is no longer kept",
                       task_status=status) from None
    except StoreUnavailable as exc:
        raise ApiError(503, "result_store_unavailable", f"the result store did not answer: "
                       f"{exc}", {"Retry-After": "5"}) from None


def _active(ctype: str) -> bool:
    return ctype.split(";", 1)[0].strip().lower() in ACTIVE_TYPES


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover - makes this an async generator


class _Unsatisfiable(Exception):
    """A range outside the body: 416."""


async def _signable_s(rt: Runtime, task_id: str, ref: str) -> int:
    """How long a presigned URL of the object may be valid: SIGNED_S, less when the object
    goes sooner (its deletion was scheduled at the first read, status-6.lua, and is never put
    off), with SIGNED_MARGIN_S left for a download begun at the last moment; 0 when less than
    MIN_SIGNED_S would be left (a link that fails half-way is worse than none)."""
    delivered = rt.keys.delivered(endpoint_of(task_id))
    async with rt.redis.pipeline(transaction=False) as pipe:
        queue_time(pipe, delivered)
        # By its object's key (read from Redis), or by its id (read from its SQL row): the
        # row and its object go together either way.
        pipe.zmscore(delivered, [ref, task_id])
        (now_s, now_us), dues = await pipe.execute()
    due = min((float(d) for d in dues if d is not None), default=None)
    if due is None:
        return SIGNED_S
    left_s = (due - (int(now_s) * 1000 + int(now_us) // 1000)) / 1000 - SIGNED_MARGIN_S
    return min(SIGNED_S, int(left_s)) if left_s >= MIN_SIGNED_S else 0


def _same_answer(if_range: str | None, etag: str | None) -> bool:
    """Whether a Range may be served under this If-Range (RFC 9110 13.1.5): none given, or the
    answer's strong ETag. A date never matches: no Last-Modified is sent to compare it with."""
    return if_range is None or (etag is not None and not etag.startswith("W/")
                                and if_range.strip() == etag)


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=` range as (start, end exclusive); None to serve the whole body (no range,
    one we do not serve: several ranges, another unit, or an invalid one, which RFC 9110
    says to ignore); _Unsatisfiable outside it. A header longer than any sane range is
    ignored before a digit is read: int() of thousands of digits raises (a 500 otherwise)."""
    if not header or len(header) > RANGE_MAX_CHARS:
        return None
    m = RANGE.match(header.strip())
    if m is None or (not m[1] and not m[2]):
        return None
    if not m[1]:  # the last N bytes
        n = int(m[2])
        if n <= 0 or size <= 0:
            raise _Unsatisfiable
        return max(0, size - n), size
    start = int(m[1])
    if m[2] and int(m[2]) < start:  # invalid (last before first): ignored
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, min(size, int(m[2]) + 1) if m[2] else size
