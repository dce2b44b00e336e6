"""Reading large results under pressure (issue "Hardening 2", items 1 and 2): one key's
parallel reads are bounded (429), a reader that stops reading is cut off after
QGW_SEND_TIMEOUT_S, and sixty-four of them pin little memory; against a `qgw api` process."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import listening

StartApi = Callable[[], Awaitable[str]]
SIZE = 32 << 20
SEND_TIMEOUT_S = 2


@pytest.fixture
def env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "QGW_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S), "QGW_MAX_LARGE_READS_PER_KEY": "2"}


async def _large_result(gateway: Gateway, upstream: str,
                        start_dispatcher: Callable[[], Awaitable[Runtime]],
                        size: int = SIZE) -> tuple[dict[str, str], str]:
    gateway.rt.settings.max_result_bytes = 64 << 20
    await gateway.add_endpoint("reads", f"{upstream}/reads", timeout_ms=60_000)
    auth = await gateway.new_key()
    await start_dispatcher()
    task = await gateway.submit(auth, f"{upstream}/reads",
                                headers={"X-Mock-Binary": [f"{size};seed=5"]})
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=60)
    assert done["result_encoding"] == "external", done
    return auth, task["task_id"]


def _stalled_reader(base: str, auth: dict[str, str], tid: str) -> socket.socket:
    """A connection that asks for the result and then reads nothing."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.sendall(f"GET /api/v1/tasks/{tid}/result HTTP/1.1\r\nHost: {host}\r\n"
                 f"Authorization: {auth['Authorization']}\r\n\r\n".encode())
    return sock


def _drain(sock: socket.socket, within_s: float) -> tuple[int, bool]:
    """Bytes read until the server closed (True) or `within_s` passed (False)."""
    sock.settimeout(0.5)
    got, deadline = 0, time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            return got, True
        if not data:
            return got, True
        got += len(data)
    return got, False


@pytest.fixture(autouse=True)
def _settings_for_upload(settings: Any) -> None:
    settings.max_result_bytes = 64 << 20


async def test_a_keys_parallel_large_reads_are_bounded_and_stalled_ones_cut_off(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    start_api: StartApi,
) -> None:
    auth, tid = await _large_result(gateway, upstream, start_dispatcher)
    base = await start_api()
    stalled = [_stalled_reader(base, auth, tid) for _ in range(2)]
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        r = await http.get(f"/api/v1/tasks/{tid}/result", headers=auth)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_reads"
        # Another key's submit and status are not held up meanwhile.
        t0 = time.monotonic()
        assert (await http.get(f"/api/v1/tasks/{tid}", headers=auth)).status_code == 200
        assert time.monotonic() - t0 < 1
        # The stalled readers are cut off after the send deadline, their slots given back.
        await asyncio.sleep(SEND_TIMEOUT_S + 2)
        for sock in stalled:
            got, closed = await asyncio.to_thread(_drain, sock, SEND_TIMEOUT_S + 15)
            assert closed and got < SIZE, (got, closed)
            sock.close()
        r = await http.get(f"/api/v1/tasks/{tid}/result", headers=auth)
        assert r.status_code == 200 and len(r.content) == SIZE


async def test_sixty_four_stalled_readers_pin_little_memory(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    start_api: StartApi, env: dict[str, str],
) -> None:
    """64 sockets (32 keys, two reads each) that never read an 8 MB result: the API process
    grows by at most 64 MB, and every one is closed after the send deadline."""
    auth, tid = await _large_result(gateway, upstream, start_dispatcher, 8 << 20)
    keys = [await gateway.new_key(user_id=1) for _ in range(31)]  # the owner's other keys
    base = await start_api()
    api = listening(int(base.rsplit(":", 1)[1]))
    await asyncio.sleep(1.0)
    before = api.memory_info().rss
    sockets = [_stalled_reader(base, k, tid) for k in (auth, *keys) for _ in range(2)]
    await asyncio.sleep(1.5)
    grown = api.memory_info().rss - before
    print(f"64 stalled readers of an 8 MB result: the API process grew {grown / 2**20:.1f} MiB")
    assert grown < 64 << 20, f"grew {grown / 2**20:.1f} MiB"
    results = await asyncio.gather(*(asyncio.to_thread(_drain, s, SEND_TIMEOUT_S + 20)
                                     for s in sockets))
    assert all(closed for _, closed in results), results
    for s in sockets:
        s.close()
