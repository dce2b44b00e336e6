"""Readers that never read (issue "Hardening 2", item 2): 64 sockets that ask for an 8 MB task
and then read nothing must neither pin the answer's megabytes in the API process nor stay open:
they are cut off (aborted, the unsent bytes dropped) once QGW_SEND_TIMEOUT_S has passed without
progress. Against a `qgw api` process, sockets with a small receive buffer that never recv.

`inline`: QGW_RESULT_INLINE_BYTES above the answer, so the status JSON and the /events stream
carry the 8 MB, and /result serves its bytes from Redis (a third of the sockets each);
`store`: the answer is in the result store and the sockets ask /result. On one Redis: what is
measured is the API process's memory and sockets. Stalled readers of distinct tasks each pin
their own answer: those share the process's memory budget for large answers
(app/answer_cache.py), readers beyond it refused."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import psutil
import pytest

from app.runtime import Runtime
from app.settings import MAX_INLINE_BYTES, Settings
from tests.conftest import Gateway
from tests.servers import listening

StartApi = Callable[[], Awaitable[str]]
SIZE = 8 << 20
SOCKETS = 64
SEND_TIMEOUT_S = 3
MAX_GROWTH = 64 << 20


@pytest.fixture(params=["inline", "store"])
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    settings.max_result_bytes = 16 << 20
    settings.read_ttl_s = 300
    if request.param == "inline":
        settings.result_inline_bytes = MAX_INLINE_BYTES
    return settings


@pytest.fixture
def env(env: dict[str, str], settings: Settings) -> dict[str, str]:
    return {**env, "QGW_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S), "QGW_READ_TTL_S": "300",
            "QGW_MAX_LARGE_READS_PER_KEY": str(SOCKETS)}  # every socket gets its answer


async def _api_process(start_api: StartApi) -> tuple[int, psutil.Process]:
    """A started `qgw api`: its port and its process, settled (its RSS measured from here)."""
    base = await start_api()
    port = int(base.rsplit(":", 1)[1])
    api = listening(port)
    await asyncio.sleep(1.0)
    return port, api


def _stalled(port: int, auth: dict[str, str], path: str) -> socket.socket:
    """A connection that asks for `path` and never reads: a 4 KiB receive window."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: "
                 f"{auth['Authorization']}\r\n\r\n".encode())
    return sock


def _open_to(api: psutil.Process, ports: set[int]) -> int:
    """How many of the API's connections still lead to these (client) ports."""
    return sum(1 for c in api.net_connections("tcp") if c.raddr and c.raddr.port in ports
               and c.status == psutil.CONN_ESTABLISHED)


def _after_close(sock: socket.socket) -> int:
    """Bytes still readable before the end (EOF or reset): what the server had sent; at most
    the whole answer (a socket left open keeps giving it)."""
    sock.settimeout(1)
    got = 0
    try:
        while got < SIZE and (data := sock.recv(1 << 20)):
            got += len(data)
    except OSError:  # reset: the server aborted the connection
        pass
    return got


async def test_readers_that_never_read_pin_little_and_are_cut_off(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    start_api: StartApi, settings: Settings,
) -> None:
    await gateway.add_endpoint("big", f"{upstream}/big", timeout_ms=60_000)
    auth = await gateway.new_key()
    dispatcher = await start_dispatcher()
    task = await gateway.submit(auth, f"{upstream}/big", headers={"X-Mock-Body-Bytes": [str(SIZE)]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=60)
    assert done["result_bytes"] == SIZE, done
    await dispatcher.stop(grace_s=1)
    tid = task["task_id"]
    inline = settings.result_inline_bytes >= SIZE
    paths = ([f"/api/v1/tasks/{tid}", f"/api/v1/tasks/{tid}/events",
              f"/api/v1/tasks/{tid}/result"] if inline
             else [f"/api/v1/tasks/{tid}/result"])
    port, api = await _api_process(start_api)
    before = api.memory_info().rss
    started = time.monotonic()
    sockets = [_stalled(port, auth, paths[i % len(paths)]) for i in range(SOCKETS)]
    ports = {s.getsockname()[1] for s in sockets}
    await asyncio.sleep(1.5)  # every answer under way, each stalled on its socket
    assert _open_to(api, ports) == SOCKETS
    grown = api.memory_info().rss - before
    # Closed by the server within the deadline and a margin, while the clients read nothing.
    while _open_to(api, ports) and time.monotonic() - started < SEND_TIMEOUT_S + 10:
        grown = max(grown, api.memory_info().rss - before)
        await asyncio.sleep(0.1)
    closed_after = time.monotonic() - started
    still_open = _open_to(api, ports)
    received = await asyncio.gather(*(asyncio.to_thread(_after_close, s) for s in sockets))
    for s in sockets:
        s.close()
    print(f"{len(paths)} paths, {SOCKETS} stalled sockets of an 8 MB task: the API grew "
          f"{grown / 2**20:.1f} MiB, closed them {closed_after:.1f} s after their requests "
          f"(send deadline {SEND_TIMEOUT_S} s); at most {max(received) / 2**10:.0f} KiB "
          "reached a socket")
    assert still_open == 0, f"{still_open} of {SOCKETS} still open after {closed_after:.1f} s"
    assert grown <= MAX_GROWTH, f"grew {grown / 2**20:.1f} MiB"
    assert max(received) < SIZE // 2, received  # cut off, not drained


#: Distinct tasks for the budget test, one stalled reader each: three and eight times what the
#: budget holds (64, the review's figure, set up one after the other in about 15 s). Before the
#: budget, 24 all got their answer and grew the process 225 MiB; of 64, most were answered 503
#: (their fills together held Redis past its reply timeout) and the rest stalled.
TASKS = (24, 64)
#: Beyond the budget's 64 MiB: the process's own churn, not pinned answers (allocator slack,
#: the fills' copies freed after them, per-connection state). The one-task test above pins a
#: single 8 MB answer and grows 28-43 MiB: up to ~35 MiB of that is such churn. Measured
#: here: 68-83 MiB in all (6 answers of 8 MiB pinned).
ALLOWANCE = 40 << 20


def _answered(sock: socket.socket) -> int:
    """The status code of what the server has sent so far (0: nothing yet), read without
    taking it from the socket."""
    try:
        head = sock.recv(12, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") and len(head) == 12 else 0


@pytest.mark.parametrize("settings", ["inline"], indirect=True)
@pytest.mark.parametrize("tasks", TASKS)
async def test_stalled_readers_of_distinct_tasks_stay_within_the_memory_budget(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    start_api: StartApi, tasks: int,
) -> None:
    """One stalled reader per task, of `tasks` distinct 8 MB tasks, on eight keys of one user
    (at most eight readers each: the per-key bound out of the way): the answers they pin stay
    within the process's 64 MiB, the readers beyond it are answered 429 too_many_reads, and the
    stalled ones are cut off at the deadline. Before the budget, each pinned its own 8 MB
    answer (the review measured +555 MiB for 64)."""
    await gateway.add_endpoint("big", f"{upstream}/big", timeout_ms=60_000)
    keys = [await gateway.new_key() for _ in range(8)]  # 8 each: the per-key bound's default
    dispatcher = await start_dispatcher()
    tids = []
    for _ in range(tasks):  # one at a time: polling them all re-reads megabytes per task
        task = await gateway.submit(keys[0], f"{upstream}/big",
                                    headers={"X-Mock-Body-Bytes": [str(SIZE)]})
        (done,) = await gateway.wait_finished(keys[0], [task["task_id"]], timeout=60)
        assert done["result_bytes"] == SIZE, done
        tids.append(task["task_id"])
    await dispatcher.stop(grace_s=1)
    port, api = await _api_process(start_api)
    before = api.memory_info().rss
    started = time.monotonic()
    paths = [f"/api/v1/tasks/{tid}" + ("/result" if i % 2 else "") for i, tid in enumerate(tids)]
    sockets = [_stalled(port, keys[i % len(keys)], path) for i, path in enumerate(paths)]
    grown = 0
    while not all(codes := [_answered(s) for s in sockets]) and time.monotonic() - started < 10:
        grown = max(grown, api.memory_info().rss - before)
        await asyncio.sleep(0.1)
    stalled = {s.getsockname()[1] for s, code in zip(sockets, codes, strict=True) if code == 200}
    refused = codes.count(429)
    while _open_to(api, stalled) and time.monotonic() - started < SEND_TIMEOUT_S + 10:
        grown = max(grown, api.memory_info().rss - before)
        await asyncio.sleep(0.1)
    closed_after = time.monotonic() - started
    still_open = _open_to(api, stalled)
    for s in sockets:
        s.close()
    print(f"{tasks} stalled readers of distinct 8 MB tasks: {len(stalled)} answered, {refused} "
          f"refused; the API grew {grown / 2**20:.1f} MiB; the stalled closed after "
          f"{closed_after:.1f} s (send deadline {SEND_TIMEOUT_S} s)")
    assert len(stalled) + refused == tasks, codes
    assert len(stalled) <= MAX_GROWTH // SIZE and refused >= tasks - MAX_GROWTH // SIZE, codes
    assert still_open == 0, f"{still_open} of {len(stalled)} still open after {closed_after:.1f} s"
    assert grown <= MAX_GROWTH + ALLOWANCE, f"grew {grown / 2**20:.1f} MiB"
