"""A lean flood of reads, run as its own process so that its CPU is not the test's: N keep-alive
connections each GET one path over and over for a while, reading every answer whole, then print
a JSON summary (answers by status, bytes read).

    python -m tests.readers <base URL> <path> <Authorization value> <connections> <seconds>
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

READ = 1 << 20


async def _reader(host: str, port: int, request: bytes, until: float, counts: Counter[str]
                  ) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=READ)
    try:
        while time.monotonic() < until:
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                # Closed between answers, before a byte of this one: the server's keep-alive
                # timeout met a request sent as it closed (this process is niced: on a busy
                # machine it can sit idle that long). A client sends such a request again.
                counts["reconnected"] += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port, limit=READ)
                continue
            status = head[9:12].decode()
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            counts[status] += 1
            while length > 0:  # read and drop: nothing of the body is kept
                chunk = await reader.read(min(READ, length))
                if not chunk:
                    raise ConnectionError("closed mid-answer")
                length -= len(chunk)
                counts["bytes"] += len(chunk)
    except (OSError, asyncio.IncompleteReadError) as exc:
        counts[f"error {type(exc).__name__}"] += 1
    finally:
        writer.close()


async def main(base: str, path: str, auth: str, n: int, seconds: float) -> None:
    host, _, port = base.removeprefix("http://").partition(":")
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\n\r\n").encode()
    counts: Counter[str] = Counter()
    until = time.monotonic() + seconds
    await asyncio.gather(*(_reader(host, int(port), request, until, counts) for _ in range(n)))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    base_, path_, auth_, n_, seconds_ = sys.argv[1:6]
    asyncio.run(main(base_, path_, auth_, int(n_), float(seconds_)))
