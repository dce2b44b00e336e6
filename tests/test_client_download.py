"""The Python client's downloads (`Client.download`, `Result.save`, `AsyncClient.download`,
`Result.asave`): a result in the store streamed to disk in bounded memory, resumed after a cut,
never left truncated under its name. Against real `qgw api` and `qgw dispatcher` processes,
the `file://` result store and the mock upstream; a cut is a real connection closed mid-answer
by a TCP proxy in between."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import select
import stat
import subprocess
import tracemalloc
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from queue_gateway_client import (
    ApiError,
    AsyncClient,
    Client,
    GatewayUnreachable,
    ResultNotRead,
    TaskFailed,
)
from queue_gateway_client._download import CHUNK

from app.mock_upstream import binary_digest
from app.settings import Settings
from tests.conftest import Gateway

StartApi = Callable[[], Awaitable[str]]
Spawn = Callable[..., subprocess.Popen[bytes]]
MB = 1_000_000
SIZE = 40 * MB  # far over QGW_RESULT_INLINE_BYTES: in the result store
CUT = 5 * MB
#: What a download may hold at its peak: a fraction of the answer (a load would hold all of it).
MEMORY = SIZE // 10
RANGE_HEADERS = re.compile(rb"(?im)^(if-)?range:[^\r\n]*\r\n")


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_result_bytes": 64 << 20})


@dataclass(frozen=True)
class Sent:
    """A request the client sent for /result, and the head of its answer."""

    range: str | None
    if_range: str | None
    status: int
    content_range: str | None

    @classmethod
    def of(cls, request: httpx.Request, response: httpx.Response) -> Sent:
        return cls(request.headers.get("range"), request.headers.get("if-range"),
                   response.status_code, response.headers.get("content-range"))


class Recording(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Sent] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/result"):
            self.sent.append(Sent.of(request, response))
        return response


class AsyncRecording(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Sent] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path.endswith("/result"):
            self.sent.append(Sent.of(request, response))
        return response


@dataclass
class Connection:
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]
    armed: bool = False  # its next answer is the one to cut


class CuttingProxy:
    """A TCP proxy in front of the gateway. The answer to the first `/result` request that
    passes is cut after `cut` bytes of its body (the proxy closes the connection: to the
    client, a connection lost mid-way). Later requests pass as they are, or with their
    `Range` and `If-Range` dropped (`strip_range`: a middlebox that does not pass them);
    with `refuse`, connections opened after the cut are closed at once (the gateway gone)."""

    def __init__(self, base: str, cut: int, *, strip_range: bool = False,
                 refuse: bool = False) -> None:
        self.port = int(base.rsplit(":", 1)[1])
        self.cut, self.strip_range, self.refuse = cut, strip_range, refuse
        self.cut_taken = False
        self._open: dict[asyncio.Task[None], Connection] = {}

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        handlers = list(self._open.items())
        for _, conn in handlers:  # their pumps then see the ends and return
            for writer in conn.writers:
                writer.close()
        if handlers:
            await asyncio.wait([task for task, _ in handlers], timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse and self.cut_taken:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        conn = Connection((writer, up_writer))
        task = asyncio.current_task()
        assert task is not None
        self._open[task] = conn
        pumps = [asyncio.create_task(self._requests(reader, up_writer, conn)),
                 asyncio.create_task(self._answers(up_reader, writer, conn))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            writer.close()  # what was written goes first, then the FIN
            up_writer.close()
            del self._open[task]

    async def _requests(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter,
                        conn: Connection) -> None:
        while data := await reader.read(1 << 16):
            if b"/result" in data.split(b"\r\n", 1)[0]:  # its request line
                if not self.cut_taken:
                    self.cut_taken = conn.armed = True
                elif self.strip_range:
                    data = RANGE_HEADERS.sub(b"", data)
            up.write(data)
            await up.drain()

    async def _answers(self, up: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       conn: Connection) -> None:
        head = b""
        left: int | None = -1  # the bytes still to pass on; -1: no limit, None: a head
        while data := await up.read(1 << 16):
            if conn.armed:  # HTTP/1.1: the answer to the request just armed, nothing before
                conn.armed, left = False, None
            if left is None:  # the cut counts the body only
                head += data
                if b"\r\n\r\n" not in head:
                    continue
                data, left = head, head.index(b"\r\n\r\n") + 4 + self.cut
            if left >= 0:
                data = data[:left]
                left -= len(data)
            writer.write(data)
            await writer.drain()
            if left == 0:
                return


def file_digest(path: Path) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def _served(gateway: Gateway, upstream: str, start_api: StartApi, spawn: Spawn,
                  name: str, **fields: object) -> tuple[str, str, str]:
    """A real API process and dispatcher for endpoint `name`: its URL, the API's base URL
    and a new API key."""
    url = f"{upstream}/{name}"
    await gateway.add_endpoint(name, url, timeout_ms=120_000, **fields)
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 1, "max_priority": 5})
    base = await start_api()
    spawn()
    return url, base, str(r.json()["key"])


async def _external(base: str, key: str, url: str, size: int, seed: int) -> str:
    """Submit a call answered with `size` bytes, wait until it completed with its answer in
    the store; its task id."""
    async with AsyncClient(base, key) as qgw:
        task = await qgw.submit(url, headers={"X-Mock-Binary": [f"{size};seed={seed}"]})
        final = await task.wait(timeout=120)
    assert final.task_status == "completed", final
    assert final.raw["result_encoding"] == "external" and final.raw["result_bytes"] == size
    task_id: str = task.task_id  # typed when mypy sees clients/python (an editable install)
    return task_id


async def test_save_streams_a_stored_result_to_disk_in_bounded_memory(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn,
    tmp_path: Path,
) -> None:
    """`Task.result()` leaves a result in the store on the gateway; `.save()` streams it:
    byte-exact, peak memory a fraction of its size, `.content` never loaded."""
    url, base, key = await _served(gateway, upstream, start_api, dispatcher_process, "dl-save")
    out = tmp_path / "out"
    out.mkdir()
    transport = Recording()

    def run() -> tuple[Path, int, bool]:
        with Client(base, key, transport=transport) as qgw:
            task = qgw.submit(url, headers={"X-Mock-Binary": [f"{SIZE};seed=11"]})
            result = task.result(timeout=120)
            assert transport.sent == []  # nothing read yet
            assert result == "" and result.size == SIZE and not result.loaded
            assert result.content_type == "image/png" and result.status_code == 200
            tracemalloc.start()
            try:
                saved = result.save(out / "video.png")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            return saved, peak, result.loaded

    saved, peak, loaded = await asyncio.to_thread(run)
    assert saved == out / "video.png" and saved.stat().st_size == SIZE
    assert file_digest(saved) == binary_digest(SIZE, 11)
    assert peak < MEMORY, f"{peak} bytes held to save {SIZE}"
    assert not loaded
    assert [s.status for s in transport.sent] == [200]
    assert leftovers(out) == ["video.png"]  # no part file left beside it


async def test_content_is_read_when_first_used_even_after_the_client_closed(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn,
    tmp_path: Path,
) -> None:
    """`.content` of a `Client`'s result in the store is as before, read on first use (once);
    also once its client's `with` block has ended (it was read at once before), unless that
    client had a transport of the caller's, which closed with it: then ResultNotRead. Saved
    to a pipe, it is written into the pipe, not renamed over it."""
    url, base, key = await _served(gateway, upstream, start_api, dispatcher_process, "dl-lazy")
    tid = await _external(base, key, url, 2 * MB, 12)
    want = binary_digest(2 * MB, 12)
    transport = Recording()
    out = tmp_path / "out"
    out.mkdir()
    pipe = out / "pipe"
    os.mkfifo(pipe)

    def drain(fd: int) -> bytes:
        """The SHA-256 of 2 MB read from the pipe, or of what came before 10 s of silence
        (a pipe replaced by a file gets nothing)."""
        h, left = hashlib.sha256(), 2 * MB
        while left and select.select([fd], [], [], 10)[0]:
            chunk = os.read(fd, min(left, 1 << 16))
            h.update(chunk)
            left -= len(chunk)
        return h.digest()

    def run() -> tuple[bytes, bytes]:
        with Client(base, key, transport=transport) as qgw:
            inside = qgw.task(tid).result(timeout=10)
            assert transport.sent == []
            first = hashlib.sha256(inside.content).digest()
            assert inside.content is inside.content and inside.loaded
            assert len(transport.sent) == 1
            stranded = qgw.task(tid).result(timeout=10)
        with pytest.raises(ResultNotRead, match="closed"):
            _ = stranded.content
        with Client(base, key) as qgw:
            after = qgw.task(tid).result(timeout=10)
            piped = qgw.task(tid).result(timeout=10)
            # Read and write ends held here: the save's open does not wait for a reader.
            fd = os.open(pipe, os.O_RDWR)
            try:
                with ThreadPoolExecutor(1) as reader:
                    drained = reader.submit(drain, fd)
                    assert piped.save(pipe) == pipe and not piped.loaded
                    assert drained.result(timeout=30) == want
            finally:
                os.close(fd)
        return first, hashlib.sha256(after.content).digest()

    first, later = await asyncio.to_thread(run)
    assert first == later == want
    assert stat.S_ISFIFO(pipe.stat().st_mode) and leftovers(out) == ["pipe"]


async def test_a_cut_download_resumes_with_a_range_and_the_etag(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn,
    tmp_path: Path,
) -> None:
    """The connection closes 5 MB into the answer: the client asks for the rest
    (`Range: bytes=<have>-`, `If-Range: <ETag>`), the gateway answers 206 from there, and
    the file is the answer byte for byte."""
    url, base, key = await _served(gateway, upstream, start_api, dispatcher_process, "dl-cut")
    tid = await _external(base, key, url, SIZE, 13)
    transport = Recording()
    async with CuttingProxy(base, CUT) as via:
        def run() -> Path:
            with Client(via, key, transport=transport) as qgw:
                path: Path = qgw.download(tid, tmp_path / "cut.png")
                return path

        saved = await asyncio.to_thread(run)
    assert file_digest(saved) == binary_digest(SIZE, 13)
    whole, rest = transport.sent
    assert (whole.range, whole.status) == (None, 200)
    assert rest.range is not None
    have = int(rest.range.removeprefix("bytes=").removesuffix("-"))
    assert CUT - CHUNK < have <= CUT  # from where it stopped, not from zero
    assert rest.if_range == f'"{SIZE}-13"'  # the upstream's ETag, kept by the gateway
    assert (rest.status, rest.content_range) == (206, f"bytes {have}-{SIZE - 1}/{SIZE}")


async def test_an_async_save_starts_over_when_the_range_is_not_honoured(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn,
    tmp_path: Path,
) -> None:
    """`AsyncTask.result(stream=True)` reads nothing; `.content` says so. `asave()` through a
    proxy that cuts the answer and then drops `Range`: the gateway's 200 is the whole answer
    again, and the client writes it from zero, not after what it had; in bounded memory."""
    url, base, key = await _served(gateway, upstream, start_api, dispatcher_process, "dl-over")
    tid = await _external(base, key, url, SIZE, 14)
    transport = AsyncRecording()
    async with CuttingProxy(base, CUT, strip_range=True) as via, \
            AsyncClient(via, key, transport=transport) as qgw:
        result = await qgw.task(tid).result(timeout=10, stream=True)
        assert transport.sent == [] and not result.loaded
        with pytest.raises(ResultNotRead):
            _ = result.content
        tracemalloc.start()
        try:
            saved = await result.asave(tmp_path / "over.png")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert saved.stat().st_size == SIZE and file_digest(saved) == binary_digest(SIZE, 14)
    assert peak < MEMORY, f"{peak} bytes held to save {SIZE}"
    assert [(s.range is not None, s.status) for s in transport.sent] == [(False, 200),
                                                                         (True, 200)]


async def test_a_failed_download_leaves_nothing_under_its_name(
    gateway: Gateway, upstream: str, start_api: StartApi, dispatcher_process: Spawn,
    tmp_path: Path,
) -> None:
    """Cut off, then the gateway gone: GatewayUnreachable once the retries are spent, the
    file already at the path untouched and no part file left. A task without a result
    (409), or one that failed, writes nothing either; nor does a directory as the target,
    or an async result read after its client closed."""
    url, base, key = await _served(gateway, upstream, start_api, dispatcher_process, "dl-fail",
                                   max_retries=0)
    tid = await _external(base, key, url, SIZE, 15)
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.png").write_bytes(b"the previous one")
    async with CuttingProxy(base, CUT, refuse=True) as via:
        def run() -> None:
            with Client(via, key, retries=2) as qgw:
                qgw.download(tid, out / "kept.png")

        with pytest.raises(GatewayUnreachable, match="of 40000000 bytes"):
            await asyncio.to_thread(run)
    assert (out / "kept.png").read_bytes() == b"the previous one"
    assert leftovers(out) == ["kept.png"]

    async with AsyncClient(base, key) as qgw:
        pending = await qgw.submit(url, headers={"X-Mock-Latency-Ms": "5000"})
        with pytest.raises(ApiError) as early:
            await qgw.download(pending.task_id, out / "early.png")
        assert early.value.status_code == 409 and early.value.code == "no_result"
        failing = await qgw.submit(url, headers={"X-Mock-Status": "500"})
        with pytest.raises(TaskFailed):
            await failing.download(out / "failed.png", timeout=30)
        with pytest.raises(IsADirectoryError):  # said at once, not after 40 MB came
            await qgw.download(tid, out)
        later = await qgw.task(tid).result(timeout=10, stream=True)
    with pytest.raises(ResultNotRead):  # its client is closed: said so, not httpx's error
        await later.aread()
    assert leftovers(out) == ["kept.png"]
