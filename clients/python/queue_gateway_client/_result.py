"""A finished task's answer: its bytes and type, and the `task_result` string it always was.

An answer the status JSON carries (inline) is in memory at once. One in the result store
(`result_encoding: "external"`, any size up to gigabytes) is not: its bytes stay on the gateway
until asked for, and `save()` streams them to disk without ever holding them whole."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from queue_gateway_client._common import QueueGatewayError
from queue_gateway_client._download import Download

PathLike = str | os.PathLike[str]


class ResultNotRead(QueueGatewayError):
    """`.content` (`.text`, `.json()`, `.save()`) of an `AsyncTask.result(stream=True)` whose
    bytes have not been read: `await result.aread()` (or `await result.asave(path)`) first."""


class Remote(Protocol):
    """An external result's bytes on the gateway, as a `Client` reads them."""

    def read(self) -> bytes: ...

    def save(self, path: PathLike) -> Path: ...


@runtime_checkable
class AsyncRemote(Protocol):
    """An external result's bytes on the gateway, as an `AsyncClient` reads them."""

    async def aread(self) -> bytes: ...

    async def asave(self, path: PathLike) -> Path: ...


class Result(str):
    """The business API's answer. As a `str` it is `task_result` as before (the text of a text
    answer, "" for one in the result store); `.content` is its bytes exactly as the upstream
    sent them, `.text` those bytes as text, `.json()` parsed, `.content_type` its type, `.size`
    its length, `.save(path)` writes the bytes to a file.

    An external result's bytes are read from `/result` when first used: `.content` reads them
    into memory (once; a `Client`'s result only, see `aread()`), `.save(path)` streams them to
    disk (and so never loads them). `.loaded` says whether they are in memory."""

    content_type: str | None
    status_code: int | None
    size: int | None
    _content: bytes | None
    _remote: Remote | AsyncRemote | None

    def __new__(cls, task_result: str, content: bytes | None, content_type: str | None,
                status_code: int | None, *, size: int | None = None,
                remote: Remote | AsyncRemote | None = None) -> Result:
        if content is None and remote is None:
            raise TypeError("a Result needs its content or where to read it")
        self = super().__new__(cls, task_result)
        self.content_type, self.status_code = content_type, status_code
        self.size = len(content) if content is not None else size
        self._content, self._remote = content, remote
        return self

    @property
    def loaded(self) -> bool:
        return self._content is not None

    @property
    def content(self) -> bytes:
        if self._content is None:
            self._content = self._remote_sync("`.content`").read()
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode(_charset(self.content_type) or "utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def save(self, path: PathLike) -> Path:
        """Write the bytes to `path` (replaced whole, never left truncated); an external
        result's are streamed from the gateway, not loaded."""
        if self._content is not None:
            return _write(Path(path), self._content)
        return self._remote_sync("`.save()`").save(path)

    async def aread(self) -> bytes:
        """`.content`, read first if it is not yet (an `AsyncClient`'s result: the awaitable
        way; a `Client`'s reads it as `.content` does)."""
        if self._content is None and isinstance(self._remote, AsyncRemote):
            self._content = await self._remote.aread()
        return self.content

    async def asave(self, path: PathLike) -> Path:
        """`save()` for an `AsyncClient`'s result: an external one is streamed from the
        gateway without blocking the event loop."""
        if self._content is None and isinstance(self._remote, AsyncRemote):
            return await self._remote.asave(path)
        return await asyncio.to_thread(self.save, path)  # a write and an fsync: off the loop

    def _remote_sync(self, what: str) -> Remote:
        if self._remote is None or isinstance(self._remote, AsyncRemote):
            raise ResultNotRead(f"{what} of a result taken with stream=True: "
                                "`await result.aread()` or `await result.asave(path)` first")
        return self._remote


def is_external(raw: dict[str, Any]) -> bool:
    """Whether the status JSON leaves the body out: it is read from `/result`, and only then."""
    return raw.get("result_encoding") == "external"


def needs_download(raw: dict[str, Any]) -> bool:
    """Whether an inline body must come from `/result` along with the status: text in a
    charset its bytes cannot be rebuilt from with certainty (small: it is inline)."""
    cs = _charset(raw.get("result_content_type"))
    return raw.get("result_encoding") is None and cs is not None and \
        cs.lower().replace("_", "-") not in ("utf-8", "utf8")


def from_status(raw: dict[str, Any], downloaded: bytes | None,
                remote: Remote | AsyncRemote | None = None) -> Result:
    """The Result of a completed task's status JSON: its bytes from the JSON, `downloaded`
    from `/result`, or (external) read from `remote` when first asked for."""
    text = raw.get("task_result") or ""
    content: bytes | None
    if downloaded is not None:
        content = downloaded
    elif is_external(raw):
        content = None
    elif raw.get("result_encoding") == "base64":
        content = base64.b64decode(text)
    else:
        content = text.encode("utf-8")
    return Result(text, content, raw.get("result_content_type"), raw.get("result_status_code"),
                  size=raw.get("result_bytes"), remote=remote)


def _write(target: Path, content: bytes) -> Path:
    """`content` to `target` through a part file, like a download: a failed write leaves the
    target as it was."""
    out = Download(target)
    try:
        out.write(content)
        return out.commit()
    finally:
        out.discard()


def _charset(content_type: str | None) -> str | None:
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"') or None
    return None
