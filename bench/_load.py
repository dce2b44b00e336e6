"""A lean HTTP/1.1 load generator (keep-alive, raw asyncio streams) and process helpers.

The client is kept cheap on purpose: on a 2-core machine it shares the CPU with the server under
test, and every target is measured with the same client in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class Result:
    requests: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def build_request(method: str, path: str, headers: dict[str, str], body: object | None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    lines = [f"{method} {path} HTTP/1.1", "Host: bench", f"Content-Length: {len(data)}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _worker(
    port: int, request: bytes, stop_at: float, budget: list[int], out: Result
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at and budget[0] > 0:
            budget[0] -= 1
            writer.write(request)
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            out.requests += 1
            out.statuses[status] += 1
    finally:
        writer.close()


async def hammer(
    port: int, request: bytes, *, seconds: float = 1e9, count: int = 1 << 62, connections: int = 16
) -> Result:
    """Send `request` over `connections` keep-alive connections until time or count runs out."""
    out, budget = Result(), [count]
    start = time.monotonic()
    await asyncio.gather(*(_worker(port, request, start + seconds, budget, out)
                           for _ in range(connections)))
    out.seconds = time.monotonic() - start
    return out


def spawn(args: list[str], env: dict[str, str] | None = None,
          cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """A process of the gateway (`cwd`: the tree whose `app` `python -m app` runs)."""
    return subprocess.Popen(args, env={**os.environ, **(env or {})}, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
