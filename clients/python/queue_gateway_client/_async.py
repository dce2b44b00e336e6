"""`AsyncClient` and its `AsyncTask`: waiting follows the task's event stream (SSE)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from queue_gateway_client._common import (
    STREAM_READ_S,
    ApiError,
    GatewayUnreachable,
    Status,
    TaskFailed,
    WaitTimeout,
    make_idempotency_key,
    raise_for_error,
    retry_after,
    sse_status,
    submit_body,
    transport_delay,
)
from queue_gateway_client._download import CHUNK, READ, Download, gave_up
from queue_gateway_client._result import (
    PathLike,
    Result,
    ResultNotRead,
    from_status,
    is_external,
    needs_download,
)


class AsyncClient:
    """`AsyncClient(base_url, api_key)`; use it as `async with`, or call `aclose()`.

    Answers 429/503 are repeated after their `Retry-After` (up to `retries` times, and only
    when that is at most `max_retry_after` seconds); so are requests a connection error cut
    off, where repeating is safe (reads, and submits: they always carry an Idempotency-Key).
    """

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0, retries: int = 8,
                 max_retry_after: float = 60.0, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.retries, self.max_retry_after = retries, max_retry_after
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
            headers={"Authorization": f"Bearer {api_key}"})

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None
                        ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def submit(
        self, target_url: str, *, method: str = "POST", body: str = "", priority: int = 0,
        task_type: str = "offline", headers: Mapping[str, str | Sequence[str]] | None = None,
        query_params: Mapping[str, str | Sequence[str]] | None = None,
        idempotency_key: str | None = None, **extra: Any,
    ) -> AsyncTask:
        """Queue a call of `target_url`; `extra` adds optional fields (`cost`, `max_wait_s`,
        `callback_url`)."""
        key = make_idempotency_key(idempotency_key)
        payload = submit_body(target_url, method, body, priority, task_type, headers,
                              query_params, extra)
        r = await self.request("POST", "/api/v1/tasks", json=payload,
                               headers={"Idempotency-Key": key}, safe=True)
        data = r.json()
        return AsyncTask(self, data["task_id"], Status.of({"task_type": task_type, **data}))

    def task(self, task_id: str) -> AsyncTask:
        """A task submitted earlier, by its id."""
        return AsyncTask(self, task_id)

    async def download(self, task_id: str, path: PathLike) -> Path:
        """Stream the answer of the ended task `task_id` (`GET /api/v1/tasks/{id}/result`) to
        `path`, a chunk at a time: memory stays bounded whatever its size, and the file is
        written off the event loop. `path` appears only once complete (a hidden `.part` file
        beside it until then, removed on failure or cancellation). A cut is resumed from
        where it stopped (`Range`); up to `retries` tries in a row that gain no byte, then
        GatewayUnreachable. Returns `path`."""
        url = f"/api/v1/tasks/{task_id}/result"
        dl = await _opened(Path(path))
        try:
            attempt = 0
            while True:
                wait, cause = None, None
                try:
                    wait = await self._download_once(url, dl, attempt)
                except httpx.TransportError as exc:
                    cause = exc
                if dl.complete:
                    return await asyncio.to_thread(dl.commit)
                if dl.progressed():
                    attempt = 0
                if attempt >= self.retries:
                    raise GatewayUnreachable(gave_up(url, dl, cause)) from cause
                await asyncio.sleep(transport_delay(attempt) if wait is None else wait)
                attempt += 1
        finally:
            dl.discard()  # not in a thread: it must happen even when cancelled

    async def _download_once(self, url: str, dl: Download, attempt: int) -> float | None:
        """One request of a download, its answer written as it comes; the Retry-After of a
        429/503 to honour before the next one, or None."""
        async with self._http.stream("GET", url, headers=dl.headers()) as r:
            if r.is_error and r.status_code not in READ:
                wait = retry_after(r, self.max_retry_after) if attempt < self.retries else None
                if wait is None:
                    await r.aread()
                    raise_for_error(r)
                return wait
            if await asyncio.to_thread(dl.start, r):  # it may empty the file
                async for chunk in r.aiter_raw(CHUNK):
                    await asyncio.to_thread(dl.write, chunk)
                dl.ended()
        return None

    async def request(self, method: str, path: str, *, safe: bool, **kwargs: Any
                      ) -> httpx.Response:
        """One API call with the retries described above; an error answer raises ApiError."""
        attempt = 0
        while True:
            try:
                r = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self.retries or not (safe or isinstance(exc, httpx.ConnectError)):
                    raise GatewayUnreachable(f"{method} {path}: {exc!r}") from exc
                await asyncio.sleep(transport_delay(attempt))
                attempt += 1
                continue
            wait = retry_after(r, self.max_retry_after)
            if wait is None or attempt >= self.retries:
                raise_for_error(r)
                return r
            await asyncio.sleep(wait)
            attempt += 1


class AsyncTask:
    """A submitted task: `status()`, `cancel()`, `wait(timeout)`, `result(timeout)`,
    `download(path, timeout)`."""

    def __init__(self, client: AsyncClient, task_id: str, submitted: Status | None = None
                 ) -> None:
        self.client, self.task_id, self.submitted = client, task_id, submitted
        self._last = submitted

    def __repr__(self) -> str:
        return f"AsyncTask({self.task_id!r})"

    async def status(self) -> Status:
        r = await self.client.request("GET", f"/api/v1/tasks/{self.task_id}", safe=True)
        self._last = Status.of(r.json())
        return self._last

    async def cancel(self) -> str:
        """Cancel it; returns `cancelled`. ApiError 409 when it has ended already."""
        try:
            r = await self.client.request("POST", f"/api/v1/tasks/{self.task_id}/cancel",
                                          safe=True)
        except ApiError as exc:
            if exc.status_code == 409 and exc.details.get("task_status") == "cancelled":
                return "cancelled"  # a repeat of a cancel whose answer was lost
            raise
        return str(r.json()["task_status"])

    # `timeout` as docs/api.md names it, the same in both clients.
    async def wait(self, timeout: float | None = None) -> Status:  # noqa: ASYNC109
        """The final status; raises WaitTimeout after `timeout` seconds (None: no limit)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._follow()
        except TimeoutError:
            raise WaitTimeout(self._last, timeout or 0) from None

    async def result(self, timeout: float | None = None,  # noqa: ASYNC109
                     *, stream: bool = False) -> Result:
        """The business API's answer (a `str` as ever, with `.content`, `.content_type`...);
        TaskFailed if the task failed, was cancelled or expired.

        The bytes of one in the result store are read into `.content` here, unless `stream`:
        then they stay on the gateway until `await result.aread()` loads them or
        `await result.asave(path)` streams them to a file (`.content` raises ResultNotRead
        until then: a property cannot await). For a large answer, `stream=True` or
        `download()`."""
        final = await self._completed(timeout)
        if is_external(final.raw):
            result = from_status(final.raw, None, ResultOnGateway(self.client, self.task_id))
            if not stream:
                await result.aread()
            return result
        body = None
        if needs_download(final.raw):
            r = await self.client.request("GET", f"/api/v1/tasks/{self.task_id}/result", safe=True)
            body = r.content
        return from_status(final.raw, body)

    async def download(self, path: PathLike,
                       timeout: float | None = None) -> Path:  # noqa: ASYNC109
        """The answer straight to a file: waits like `result(timeout)` (TaskFailed likewise),
        then streams it to `path` as `AsyncClient.download` does. Returns `path`."""
        await self._completed(timeout)
        return await self.client.download(self.task_id, path)

    async def _completed(self, timeout: float | None) -> Status:  # noqa: ASYNC109
        final = await self.wait(timeout)
        if final.task_status != "completed":
            raise TaskFailed(final)
        return final

    async def _follow(self) -> Status:
        """Read the event stream until a final status. A broken or ended stream is opened
        again: it starts with the current status, so the end is never missed."""
        http, path = self.client._http, f"/api/v1/tasks/{self.task_id}/events"
        timeout = httpx.Timeout(self.client._http.timeout.connect, read=STREAM_READ_S)
        attempt = 0
        while True:
            try:
                async with http.stream("GET", path, timeout=timeout) as r:
                    if r.status_code != 200:
                        await r.aread()
                        wait = retry_after(r, self.client.max_retry_after)
                        if wait is None:
                            raise_for_error(r)
                        await asyncio.sleep(wait or 0)
                        continue
                    attempt = 0
                    final = await self._read_events(r)
                    if final is not None:
                        return final
            except httpx.TransportError as exc:
                if attempt >= self.client.retries:
                    raise GatewayUnreachable(f"GET {path}: {exc!r}") from exc
                await asyncio.sleep(transport_delay(attempt))
                attempt += 1

    async def _read_events(self, r: httpx.Response) -> Status | None:
        lines: list[str] = []
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                continue
            status, lines = sse_status(lines), []
            if status is not None:
                self._last = status
                if status.finished:
                    return status
        return None


async def _opened(target: Path) -> Download:
    """`Download(target)` off the event loop (opening a pipe waits for its reader); should
    the caller be cancelled meanwhile, the part file it made is removed once it is made."""
    opening = asyncio.get_running_loop().run_in_executor(None, Download, target)
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_discard_opened)
        raise


def _discard_opened(opening: asyncio.Future[Download]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().discard()


class ResultOnGateway:
    """An `AsyncClient`'s external result: its bytes on the gateway, read (or streamed to a
    file) when awaited, through the client that returned it."""

    def __init__(self, client: AsyncClient, task_id: str) -> None:
        self.client, self.task_id = client, task_id

    async def aread(self) -> bytes:
        self._open()
        r = await self.client.request("GET", f"/api/v1/tasks/{self.task_id}/result", safe=True)
        return r.content

    async def asave(self, path: PathLike) -> Path:
        self._open()
        return await self.client.download(self.task_id, path)

    def _open(self) -> None:
        if self.client._http.is_closed:
            raise ResultNotRead("the AsyncClient of this result is closed: read or save it "
                                "(`aread()`, `asave(path)`) before closing the client")
