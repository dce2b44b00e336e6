"""Slow clients against a real `qgw api`: bodies have a deadline, and a client that goes away
costs one debug line, not a traceback."""

from __future__ import annotations

import asyncio
import json
import resource
import selectors
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import Gateway
from tests.servers import QGW, free_port, stop, wait_port

URL = "http://127.0.0.1:9/slow"
DEADLINE_S = 2.0
STAYERS, LEAVERS = 300, 100


def _small_fd_limit() -> None:
    """The common soft limit of 1024 open files, scaled to this test's 400 connections."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


def _stalled(port: int, auth: dict[str, str]) -> socket.socket:
    """A submit that sends its headers and one byte of its 100-byte body, then nothing."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /api/v1/tasks HTTP/1.1\r\nHost: gw\r\nAuthorization: "
              f"{auth['Authorization']}\r\nContent-Type: application/json\r\n"
              "Content-Length: 100\r\n\r\n{".encode())
    return s


def _until_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """What each socket received until the server closed it (or `timeout` passed)."""
    got = {s: b"" for s in socks}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(0.1):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(65536)
                except ConnectionError:
                    data = b""
                got[s] += data
                if not data:
                    sel.unregister(s)
    return got


def _slow_clients(port: int, auth: dict[str, str]) -> dict[str, float]:
    stayers = [_stalled(port, auth) for _ in range(STAYERS)]
    started = time.monotonic()
    for s in [_stalled(port, auth) for _ in range(LEAVERS)]:
        s.close()  # goes away mid-body
    t = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{port}/api/v1/tasks", headers=auth,
                   json={"target_url": URL}, timeout=10)
    fresh_s = time.monotonic() - t
    assert r.status_code == 202, r.text
    try:
        got = _until_closed(stayers, DEADLINE_S + 8)
    finally:
        for s in stayers:
            s.close()
    cut_s = time.monotonic() - started
    answers = [g.partition(b"\r\n\r\n") for g in got.values()]
    assert all(head.startswith(b"HTTP/1.1 408 ") for head, _, _ in answers), answers[0]
    assert json.loads(answers[0][2])["error"]["code"] == "body_timeout"
    return {"fresh_s": fresh_s, "cut_s": cut_s}


async def test_stalled_bodies_time_out_and_leave_room_for_others(
    gateway: Gateway, env: dict[str, str], tmp_path: Path
) -> None:
    """300 clients that send headers and one body byte, and 100 that then go away, against a
    `qgw api` started with a soft limit of 256 open files: a new client is still answered at
    once, the stalled ones get 408 and are closed after the deadline, and nothing in the log
    is a traceback or an error."""
    await gateway.add_endpoint("slow", URL)
    auth = await gateway.new_key()
    port, log_path = free_port(), tmp_path / "stderr.log"
    with log_path.open("wb") as stderr:
        proc = subprocess.Popen([*QGW, "api", "--port", str(port)],
                                env={**env, "QGW_BODY_TIMEOUT_S": str(DEADLINE_S)},
                                stdout=subprocess.DEVNULL, stderr=stderr,
                                preexec_fn=_small_fd_limit)
        try:
            await asyncio.to_thread(wait_port, port, 30, proc)
            figures = await asyncio.to_thread(_slow_clients, port, auth)
        finally:
            stop(proc)
    print(f"fresh submit answered in {figures['fresh_s']:.3f} s; {STAYERS} stalled clients "
          f"cut off {figures['cut_s']:.2f} s after they started")
    assert figures["fresh_s"] < DEADLINE_S * 0.75  # served now, not once the others were cut
    assert figures["cut_s"] < DEADLINE_S + 4
    text = log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text
    assert [line for line in lines if line["level"] in ("error", "critical")] == []
