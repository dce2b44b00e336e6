"""Reading a JSON body ourselves: a size limit and a deadline before parsing, and errors in
our shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from app.errors import ApiError, describe

M = TypeVar("M", bound=BaseModel)


async def read_limited(request: Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes, within QGW_BODY_TIMEOUT_S of starting to read.

    A client trickling its body (or sending headers and one byte, then nothing) would hold its
    connection and a file descriptor for ever: after the deadline it gets 408 and the
    connection is closed. One that goes away raises ClientDisconnect (app/errors.py).

    Read from the server's messages directly (Starlette's `stream()` is an async generator, a
    sixth of a proxied request's way to its submit); the body is read once, never again."""
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"the request body exceeds {limit} bytes")
    receive = request.receive
    chunks: list[bytes] = []
    seconds = request.app.state.runtime.settings.body_timeout_s
    try:
        async with asyncio.timeout(seconds):
            size, more = 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect
                    raise ClientDisconnect()
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, "body_too_large",
                                   f"the request body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, "body_timeout",
                       f"the request body did not arrive within {seconds:g} s",
                       {"Connection": "close"}) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse(model: type[M], raw: bytes) -> M:
    if not raw.strip():
        raise ApiError(400, "invalid_json", "a JSON object is required")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            raise ApiError(400, "invalid_json", "the body is not valid JSON") from None
        if all(_whole_float(e) for e in errors):
            return _with_whole_floats(model, raw)
        raise ApiError(422, "invalid_request", describe(exc)) from None


def _whole_float(err: Any) -> bool:
    value = err.get("input")
    return err["type"] == "int_type" and isinstance(value, float) and value.is_integer()


def _with_whole_floats(model: type[M], raw: bytes) -> M:
    """Again, with 3.0 read as 3: JSON Schema counts it an integer, strict pydantic does not."""
    data = json.loads(raw)
    if isinstance(data, dict):
        data = {k: int(v) if isinstance(v, float) and v.is_integer() else v
                for k, v in data.items()}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", describe(exc)) from None


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that reads its body itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}
