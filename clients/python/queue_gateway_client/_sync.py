"""`Client` and its `Task`: waiting is a long poll (`?wait=`), which the gateway holds until the
status changes, so a wait costs one request per change, not a loop of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from queue_gateway_client._common import (
    LONG_POLL_S,
    ApiError,
    GatewayUnreachable,
    Status,
    TaskFailed,
    WaitTimeout,
    make_idempotency_key,
    raise_for_error,
    remaining,
    retry_after,
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


class Client:
    """`Client(base_url, api_key)`; use it as `with`, or call `close()`.

    Answers 429/503 are repeated after their `Retry-After` (up to `retries` times, and only
    when that is at most `max_retry_after` seconds); so are requests a connection error cut
    off, where repeating is safe (reads, and submits: they always carry an Idempotency-Key).
    """

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0, retries: int = 8,
                 max_retry_after: float = 60.0, transport: httpx.BaseTransport | None = None
                 ) -> None:
        self.retries, self.max_retry_after = retries, max_retry_after
        # A client like this one, for a Result used after this one is closed (_open); not with
        # the caller's transport, which closes with it.
        self._again: Callable[[], Client] | None = None if transport is not None else partial(
            Client, base_url, api_key, timeout=timeout, retries=retries,
            max_retry_after=max_retry_after)
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
            headers={"Authorization": f"Bearer {api_key}"})

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def submit(
        self, target_url: str, *, method: str = "POST", body: str = "", priority: int = 0,
        task_type: str = "offline", headers: Mapping[str, str | Sequence[str]] | None = None,
        query_params: Mapping[str, str | Sequence[str]] | None = None,
        idempotency_key: str | None = None, **extra: Any,
    ) -> Task:
        """Queue a call of `target_url`; `extra` adds optional fields (`cost`, `max_wait_s`,
        `callback_url`)."""
        key = make_idempotency_key(idempotency_key)
        payload = submit_body(target_url, method, body, priority, task_type, headers,
                              query_params, extra)
        r = self.request("POST", "/api/v1/tasks", json=payload,
                         headers={"Idempotency-Key": key}, safe=True)
        data = r.json()
        return Task(self, data["task_id"], Status.of({"task_type": task_type, **data}))

    def task(self, task_id: str) -> Task:
        """A task submitted earlier, by its id."""
        return Task(self, task_id)

    def download(self, task_id: str, path: PathLike) -> Path:
        """Stream the answer of the ended task `task_id` (`GET /api/v1/tasks/{id}/result`) to
        `path`, a chunk at a time: memory stays bounded whatever its size. `path` appears only
        once complete (a hidden `.part` file beside it until then, removed on failure). A cut
        is resumed from where it stopped (`Range`); up to `retries` tries in a row that gain
        no byte, then GatewayUnreachable. Returns `path`."""
        url = f"/api/v1/tasks/{task_id}/result"
        dl = Download(Path(path))
        try:
            attempt = 0
            while True:
                wait, cause = None, None
                try:
                    wait = self._download_once(url, dl, attempt)
                except httpx.TransportError as exc:
                    cause = exc
                if dl.complete:
                    return dl.commit()
                if dl.progressed():
                    attempt = 0
                if attempt >= self.retries:
                    raise GatewayUnreachable(gave_up(url, dl, cause)) from cause
                time.sleep(transport_delay(attempt) if wait is None else wait)
                attempt += 1
        finally:
            dl.discard()

    def _download_once(self, url: str, dl: Download, attempt: int) -> float | None:
        """One request of a download, its answer written as it comes; the Retry-After of a
        429/503 to honour before the next one, or None."""
        with self._http.stream("GET", url, headers=dl.headers()) as r:
            if r.is_error and r.status_code not in READ:
                wait = retry_after(r, self.max_retry_after) if attempt < self.retries else None
                if wait is None:
                    r.read()
                    raise_for_error(r)
                return wait
            if dl.start(r):
                for chunk in r.iter_raw(CHUNK):
                    dl.write(chunk)
                dl.ended()
        return None

    @contextmanager
    def _open(self) -> Iterator[Client]:
        """This client or, once it is closed, a new one like it for one call: a Result used
        after its client's `with` block still reads its bytes, as when `result()` read them
        at once."""
        if not self._http.is_closed:
            yield self
        elif self._again is None:
            raise ResultNotRead("the client of this result is closed, and its transport with "
                                "it: use `.content` or `.save()` before closing it")
        else:
            with self._again() as again:
                yield again

    def request(self, method: str, path: str, *, safe: bool, **kwargs: Any) -> httpx.Response:
        """One API call with the retries described above; an error answer raises ApiError."""
        attempt = 0
        while True:
            try:
                r = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self.retries or not (safe or isinstance(exc, httpx.ConnectError)):
                    raise GatewayUnreachable(f"{method} {path}: {exc!r}") from exc
                time.sleep(transport_delay(attempt))
                attempt += 1
                continue
            wait = retry_after(r, self.max_retry_after)
            if wait is None or attempt >= self.retries:
                raise_for_error(r)
                return r
            time.sleep(wait)
            attempt += 1


class Task:
    """A submitted task: `status()`, `cancel()`, `wait(timeout)`, `result(timeout)`,
    `download(path, timeout)`."""

    def __init__(self, client: Client, task_id: str, submitted: Status | None = None) -> None:
        self.client, self.task_id, self.submitted = client, task_id, submitted

    def __repr__(self) -> str:
        return f"Task({self.task_id!r})"

    def status(self, wait: float = 0) -> Status:
        """The status now; with `wait` (seconds, at most 30), once it changes or then."""
        params = {"wait": round(wait, 3)} if wait > 0 else None
        timeout = self.client._http.timeout.read
        if wait > 0 and timeout is not None:
            timeout += wait
        r = self.client.request("GET", f"/api/v1/tasks/{self.task_id}", safe=True,
                                params=params, timeout=timeout)
        return Status.of(r.json())

    def cancel(self) -> str:
        """Cancel it; returns `cancelled`. ApiError 409 when it has ended already."""
        try:
            r = self.client.request("POST", f"/api/v1/tasks/{self.task_id}/cancel", safe=True)
        except ApiError as exc:
            if exc.status_code == 409 and exc.details.get("task_status") == "cancelled":
                return "cancelled"  # a repeat of a cancel whose answer was lost
            raise
        return str(r.json()["task_status"])

    def wait(self, timeout: float | None = None) -> Status:
        """The final status; raises WaitTimeout after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        status = self.status()
        while not status.finished:
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise WaitTimeout(status, timeout or 0)
            status = self.status(wait=LONG_POLL_S if left is None else min(LONG_POLL_S, left))
        return status

    def result(self, timeout: float | None = None) -> Result:
        """The business API's answer (a `str` as ever, with `.content`, `.content_type`...);
        TaskFailed if the task failed, was cancelled or expired. The bytes of one in the
        result store are read when first used: `.content` loads them, `.save(path)` streams
        them to a file."""
        final = self._completed(timeout)
        if is_external(final.raw):  # its bytes stay on the gateway until used
            return from_status(final.raw, None, ResultOnGateway(self.client, self.task_id))
        body = None
        if needs_download(final.raw):
            r = self.client.request("GET", f"/api/v1/tasks/{self.task_id}/result", safe=True)
            body = r.content
        return from_status(final.raw, body)

    def download(self, path: PathLike, timeout: float | None = None) -> Path:
        """The answer straight to a file: waits like `result(timeout)` (TaskFailed likewise),
        then streams it to `path` as `Client.download` does. Returns `path`."""
        self._completed(timeout)
        return self.client.download(self.task_id, path)

    def _completed(self, timeout: float | None) -> Status:
        final = self.wait(timeout)
        if final.task_status != "completed":
            raise TaskFailed(final)
        return final


class ResultOnGateway:
    """A `Client`'s external result: its bytes on the gateway, read (or streamed to a file)
    when first asked for, through the client that returned it."""

    def __init__(self, client: Client, task_id: str) -> None:
        self.client, self.task_id = client, task_id

    def read(self) -> bytes:
        with self.client._open() as client:
            return client.request("GET", f"/api/v1/tasks/{self.task_id}/result",
                                  safe=True).content

    def save(self, path: PathLike) -> Path:
        with self.client._open() as client:
            return client.download(self.task_id, path)
