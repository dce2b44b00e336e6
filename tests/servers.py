"""Real servers for tests: a Redis-compatible server and the mock upstream, as processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.embedded import server_binary

QGW = [sys.executable, "-m", "app"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """Debian's redis-server or the embedded valkey binary (QGW_TEST_REDIS_BIN picks one)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.binary = os.environ.get("QGW_TEST_REDIS_BIN") or server_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.data_dir), "--appendonly", "yes", "--save", "", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc:
            stop(self.proc)


@contextmanager
def mock_upstream(*flags: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([*QGW, "mock-upstream", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def mock_log(base: str) -> list[dict[str, object]]:
    log: list[dict[str, object]] = httpx.get(f"{base}/_mock/log").json()
    return log
