"""`qgw mock-upstream`: a slow business API for demos, tests and benchmarks.

Any path answers `{"ok": true, "n": <request number>, ...}` after `latency_ms`; more than
`concurrency` requests in flight get 429; `fail_rate` of requests get 503.  A request may ask
for a status, a latency, a cookie or a body of N bytes with `X-Mock-Status` /
`X-Mock-Latency-Ms` / `X-Mock-Set-Cookie` / `X-Mock-Body-Bytes` / `X-Mock-Reply-Headers`
(a JSON object of headers to answer with) / `X-Mock-Binary` (`<bytes>[;seed=<n>][;type=<content
type>][;chunked=1]`: that many pseudo-random bytes, the same for the same seed (`binary_body`),
streamed in chunks so that even gigabytes cost the mock no memory) / `X-Mock-Body-Base64` (exactly
those bytes, typed by a `content-type` of X-Mock-Reply-Headers); `X-Mock-Status-Times: N` keeps
that status and those headers to the first N requests of one Idempotency-Key (a refusal that
passes) (CONTROL_HEADERS: a task carries them only to an endpoint that lists them in
`forward_headers`).  It records every request: `GET /_mock/stats` gives counts (and `in_flight`,
`peak_in_flight`: calls being answered now, and the most at once), `GET /_mock/log` the requests
in arrival order (time in ms, method, path, query, Idempotency-Key, body, status, and `closed`:
when the caller closed the connection before the answer, in ms, else null), `POST /_mock/reset`
clears both and the settings below.

`POST /_mock/config` with a JSON object changes how it answers from then on: `latency_ms`,
`chunks` and `chunk_ms` (a stream's events, and the pause before each), `reject_next` (that
many next requests are refused 429, with `Retry-After: reject_after_s` and OpenAI's
`x-ratelimit-remaining-requests: 0`), `rate_per_s` (429 past that many requests in a clock
second, with the reset of that second), `hold` (true: requests arrive, are logged and counted in
flight, and wait until `POST /_mock/release`, for tests of order and cancellation).
With `--openai` (app/mock_openai.py) `/v1/chat/completions` and `/v1/embeddings` speak the
OpenAI wire format; every other path answers as above.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from app import mock_openai
from app.mock_openai import send_json as _send_json

Scope = dict[str, Any]
CONTROL_HEADERS = ("X-Mock-Status", "X-Mock-Latency-Ms", "X-Mock-Set-Cookie", "X-Mock-Body-Bytes",
                   "X-Mock-Reply-Headers", "X-Mock-Status-Times", "X-Mock-Binary",
                   "X-Mock-Body-Base64")
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


def binary_digest(size: int, seed: int = 0) -> bytes:
    """The SHA-256 of `binary_body(size, seed)`, built a chunk at a time: what a test compares
    a relayed or stored answer with, without holding it."""
    h = hashlib.sha256()
    for chunk in binary_body(size, seed):
        h.update(chunk)
    return h.digest()


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
    openai: bool = False
    chunks: int = 5
    chunk_ms: float = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    reject_next: int = 0
    reject_after_s: float = 1
    hold: bool = False
    rate_per_s: int = 0  # 0 = none; else 429 past that many requests in a clock second
    log: list[dict[str, Any]] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    seen: Counter[str] = field(default_factory=Counter)  # requests per Idempotency-Key
    _defaults: dict[str, Any] = field(default_factory=dict)
    _gate: asyncio.Event | None = None
    _second: tuple[int, int] = (0, 0)  # (clock second, requests in it) for rate_per_s

    def __post_init__(self) -> None:
        self._defaults = {name: getattr(self, name) for name in CONFIG}

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
            await self._control(path, body, send)
            return
        # A caller gone mid-answer ends its call here at once (uvicorn drops what is sent after
        # a disconnect without a word): in_flight shows what a gateway really aborted.
        entry: dict[str, Any] = {}  # filled by _serve: the log's entry of this request
        serving = asyncio.ensure_future(self._serve(scope, body, send, entry))
        gone = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait({serving, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not serving.done():
            entry["closed"] = time.time() * 1000  # a gateway aborting a call is seen here
            serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    def _gate_of(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    async def _serve(self, scope: Scope, body: bytes, send: Any, entry: dict[str, Any]
                     ) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        arrived = time.time() * 1000
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            status, rejected = int(headers.get("x-mock-status", 0)) or 200, False
            key = headers.get("idempotency-key") or ""
            self.seen[key] += 1
            if (times := headers.get("x-mock-status-times")) and self.seen[key] > int(times):
                status = 200  # told to refuse only so many times
                headers.pop("x-mock-reply-headers", None)
            if self.concurrency and self.in_flight > self.concurrency:
                status = 429
            elif self.rate_per_s and self._over_rate():
                status, rejected = 429, True
            elif self.reject_next > 0:
                self.reject_next -= 1
                status, rejected = 429, True
            elif status == 200 and random.random() < self.fail_rate:
                status = 503
            entry.update({
                "t": arrived, "method": scope["method"], "path": scope["path"],
                "query": dict(parse_qsl(scope["query_string"].decode())),
                "idempotency_key": headers.get("idempotency-key"),
                "headers": headers, "body": body.decode(errors="replace"), "status": status,
                "closed": None, "peer": list(scope.get("client") or ()),
            })
            self.log.append(entry)
            self.statuses[status] += 1
            if rejected:
                await self._refuse(send)
                return
            await self._gate_of().wait()
            latency = float(headers.get("x-mock-latency-ms", self.latency_ms))
            if latency and status != 429:
                await asyncio.sleep(latency / 1000)
            # Headers to answer with, as a JSON object (rate-limit signals, Retry-After).
            told = [(name.encode(), str(value).encode()) for name, value
                    in json.loads(headers.get("x-mock-reply-headers", "{}")).items()]
            if self.openai and status == 200 and mock_openai.is_openai_path(scope["path"]):
                await mock_openai.answer(scope["path"], body, len(self.log), self.chunks,
                                         self.chunk_ms, send, told)
                return
            if binary := headers.get("x-mock-binary"):
                await _send_binary(send, status, *_binary_spec(binary))
                return
            if raw := headers.get("x-mock-body-base64"):
                await _send_raw(send, status, base64.b64decode(raw),
                                json.loads(headers.get("x-mock-reply-headers", "{}")))
                return
            reply: Any = {"ok": 200 <= status < 300, "n": len(self.log), "path": scope["path"],
                          "echo": entry["body"]}
            if size := int(headers.get("x-mock-body-bytes", 0)):
                reply = "x" * max(0, size - 2)  # a JSON string of `size` bytes
            cookie = headers.get("x-mock-set-cookie")
            extra = [(b"set-cookie", f"{cookie}; Path=/".encode())] if cookie else []
            await _send_json(send, status, reply, extra + told)
        finally:
            self.in_flight -= 1

    def _over_rate(self) -> bool:
        now = int(time.time())
        second, count = self._second
        self._second = (now, count + 1 if second == now else 1)
        return self._second[1] > self.rate_per_s

    async def _refuse(self, send: Any) -> None:
        """A 429 as OpenAI sends it, with the pause it asks for (`reject_next`: Retry-After
        `reject_after_s`; `rate_per_s`: the rest of the clock second)."""
        if self.rate_per_s:
            reset_ms = max(1, round((1 - time.time() % 1) * 1000))
            after, reset = "1", f"{reset_ms}ms"
        else:
            after = f"{self.reject_after_s:g}"
            reset = f"{after}s"
        await _send_json(send, 429, mock_openai.RATE_LIMITED, [
            (b"retry-after", after.encode()), (b"x-ratelimit-remaining-requests", b"0"),
            (b"x-ratelimit-reset-requests", reset.encode())])

    async def _control(self, path: str, body: bytes, send: Any) -> None:
        if path == "/_mock/reset":
            self.log.clear()
            self.statuses.clear()
            self.seen.clear()
            self.peak_in_flight = self.in_flight
            self._configure(self._defaults)
            await _send_json(send, 200, {"ok": True})
        elif path == "/_mock/config":
            changes = mock_openai.request_json(body)
            unknown = set(changes) - set(CONFIG)
            if unknown:
                await _send_json(send, 400, {"error": f"unknown settings {sorted(unknown)}"})
                return
            self._configure(changes)
            await _send_json(send, 200, {name: getattr(self, name) for name in CONFIG})
        elif path == "/_mock/release":
            self._configure({"hold": False})
            await _send_json(send, 200, {"ok": True})
        elif path == "/_mock/log":
            await _send_json(send, 200, self.log)
        else:
            keys = Counter(e["idempotency_key"] for e in self.log)
            await _send_json(send, 200, {
                "received": len(self.log), "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "statuses": {str(k): v for k, v in self.statuses.items()},
                "duplicates": sum(v - 1 for k, v in keys.items() if k and v > 1),
            })

    def _configure(self, changes: dict[str, Any]) -> None:
        for name, value in changes.items():
            setattr(self, name, CONFIG[name](value))
        gate = self._gate_of()
        if self.hold:
            gate.clear()
        else:
            gate.set()


#: What POST /_mock/config may change, and each setting's type.
CONFIG: dict[str, Any] = {"latency_ms": float, "chunks": int, "chunk_ms": float,
                          "reject_next": int, "reject_after_s": float, "hold": bool,
                          "concurrency": int, "fail_rate": float, "rate_per_s": int}


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_raw(send: Any, status: int, body: bytes, reply_headers: dict[str, str]
                    ) -> None:
    """Exactly `body`, with the reply headers asked for (their content-type, if any)."""
    head = {"content-type": "application/octet-stream",
            **{k.lower(): str(v) for k, v in reply_headers.items()},
            "content-length": str(len(body))}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in head.items()]})
    await send({"type": "http.response.body", "body": body})


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

