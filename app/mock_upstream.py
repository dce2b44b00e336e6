"""`qgw mock-upstream`: a slow business API for demos, tests and benchmarks.

Any path answers `{"ok": true, "n": <request number>, ...}` after `latency_ms`; more than
`concurrency` requests in flight get 429; `fail_rate` of requests get 503.  A request may ask
for a status, a latency, a cookie or a body of N bytes with `X-Mock-Status` /
`X-Mock-Latency-Ms` / `X-Mock-Set-Cookie` / `X-Mock-Body-Bytes` / `X-Mock-Reply-Headers`
(a JSON object of headers to answer with) / `X-Mock-Binary` (`<bytes>[;seed=<n>][;type=<content
type>][;chunked=1]`: that many pseudo-random bytes, the same for the same seed (`binary_body`),
streamed in chunks so that even gigabytes cost the mock no memory); `X-Mock-Status-Times: N` keeps
that status and those headers to the first N requests of one Idempotency-Key (a refusal that
passes) (CONTROL_HEADERS: a task carries them only to an endpoint that lists them in
`forward_headers`).  It records every request:
`GET /_mock/stats` gives counts, `GET /_mock/log` the requests in arrival order (time in ms,
method, path, query, Idempotency-Key, body, status, and `closed`: when the caller closed the
connection before the answer, in ms, else null), `POST /_mock/reset` clears both.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

Scope = dict[str, Any]
CONTROL_HEADERS = ("X-Mock-Status", "X-Mock-Latency-Ms", "X-Mock-Set-Cookie", "X-Mock-Body-Bytes",
                   "X-Mock-Reply-Headers", "X-Mock-Status-Times", "X-Mock-Binary")
BINARY_CHUNK = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def binary_body(size: int, seed: int = 0) -> Iterator[bytes]:
    """The bytes `X-Mock-Binary: <size>;seed=<seed>` answers, chunk by chunk: a PNG signature,
    then pseudo-random bytes (never valid UTF-8 text past the signature, in practice)."""
    rng = random.Random(seed)
    head = PNG_SIGNATURE[:size]
    left = size - len(head)
    first = True
    while first or left > 0:
        n = min(BINARY_CHUNK, left)
        chunk = rng.randbytes(n)
        yield head + chunk if first else chunk
        left -= n
        first = False


def _binary_spec(value: str) -> tuple[int, int, str, bool]:
    size, *params = value.split(";")
    opts = dict(p.strip().split("=", 1) for p in params if "=" in p)
    return (int(size), int(opts.get("seed", 0)), opts.get("type", "image/png"),
            opts.get("chunked") == "1")


@dataclass
class MockUpstream:
    concurrency: int = 0  # 0 = no cap
    latency_ms: float = 0
    fail_rate: float = 0
    in_flight: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    seen: Counter[str] = field(default_factory=Counter)  # requests per Idempotency-Key

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path.startswith("/_mock/"):
            await self._control(path, send)
            return
        await self._serve(scope, body, receive, send)

    async def _serve(self, scope: Scope, body: bytes, receive: Any, send: Any) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        arrived = time.time() * 1000
        self.in_flight += 1
        try:
            status = int(headers.get("x-mock-status", 0)) or 200
            key = headers.get("idempotency-key") or ""
            self.seen[key] += 1
            if (times := headers.get("x-mock-status-times")) and self.seen[key] > int(times):
                status = 200  # told to refuse only so many times
                headers.pop("x-mock-reply-headers", None)
            if self.concurrency and self.in_flight > self.concurrency:
                status = 429
            elif status == 200 and random.random() < self.fail_rate:
                status = 503
            entry = {
                "t": arrived, "method": scope["method"], "path": scope["path"],
                "query": dict(parse_qsl(scope["query_string"].decode())),
                "idempotency_key": headers.get("idempotency-key"),
                "headers": headers, "body": body.decode(errors="replace"), "status": status,
                "closed": None,
            }
            self.log.append(entry)
            self.statuses[status] += 1
            latency = float(headers.get("x-mock-latency-ms", self.latency_ms))
            if latency and status != 429 and not await _held(latency / 1000, receive, entry):
                return  # the caller hung up while held: nobody to answer
            if binary := headers.get("x-mock-binary"):
                await _send_binary(send, status, *_binary_spec(binary))
                return
            reply: Any = {"ok": 200 <= status < 300, "n": len(self.log), "path": scope["path"],
                          "echo": entry["body"]}
            if size := int(headers.get("x-mock-body-bytes", 0)):
                reply = "x" * max(0, size - 2)  # a JSON string of `size` bytes
            cookie = headers.get("x-mock-set-cookie")
            extra = [(b"set-cookie", f"{cookie}; Path=/".encode())] if cookie else []
            # Headers to answer with, as a JSON object (rate-limit signals, Retry-After).
            for name, value in json.loads(headers.get("x-mock-reply-headers", "{}")).items():
                extra.append((name.encode(), str(value).encode()))
            await _send_json(send, status, reply, extra)
        finally:
            self.in_flight -= 1

    async def _control(self, path: str, send: Any) -> None:
        if path == "/_mock/reset":
            self.log.clear()
            self.statuses.clear()
            self.seen.clear()
            await _send_json(send, 200, {"ok": True})
        elif path == "/_mock/log":
            await _send_json(send, 200, self.log)
        else:
            keys = Counter(e["idempotency_key"] for e in self.log)
            await _send_json(send, 200, {
                "received": len(self.log), "in_flight": self.in_flight,
                "statuses": {str(k): v for k, v in self.statuses.items()},
                "duplicates": sum(v - 1 for k, v in keys.items() if k and v > 1),
            })


async def _held(seconds: float, receive: Any, entry: dict[str, Any]) -> bool:
    """Hold the answer `seconds`; False (and the time in `entry["closed"]`) when the caller
    closes the connection first: a gateway aborting a call is seen here."""
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait_for(asyncio.shield(gone), seconds)
    except TimeoutError:
        return True
    finally:
        gone.cancel()
    entry["closed"] = time.time() * 1000
    return False


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_binary(send: Any, status: int, size: int, seed: int, ctype: str,
                       chunked: bool) -> None:
    """`chunked`: no Content-Length, so its size is known only once it has all come."""
    length = [] if chunked else [(b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()), *length,
                            (b"content-disposition", b'attachment; filename="out.bin"'),
                            (b"etag", f'"{size}-{seed}"'.encode())]})
    for chunk in binary_body(size, seed):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _send_json(send: Any, status: int, payload: Any,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
