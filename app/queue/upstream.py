"""Calling the business API: headers from an allow-list, the retry policy, the outcome."""

from __future__ import annotations

import json
import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from app.endpoints import DEFAULT_FORWARD
from app.queue.signals import pause_s, retry_after


def forwardable(headers: dict[str, list[str]], allowed: frozenset[str]) -> list[tuple[str, str]]:
    """The caller's headers whose (lower-case) names are in `allowed`; an allow-list, so a
    header nobody chose to forward (a credential, an identity, an override) never leaves."""
    return [(name, v) for name, values in headers.items() if name.lower() in allowed
            for v in values]


def upstream_client(max_connections: int) -> aiohttp.ClientSession:
    """The one client for business APIs: aiohttp's session, used directly.

    Neither httpx's own pool (it slows as connections are added) nor httpx over aiohttp's pool:
    at 1,000 calls a second httpx's request and response models took a third of a dispatcher's
    CPU (bench/upstream_client.py compares the three). No cookie jar: one session serves every
    caller, and a cookie set by a call for one user must never ride along on another's.
    Redirects are not followed (per call): the gateway calls only URLs somebody registered.
    """
    connector = aiohttp.TCPConnector(limit=max_connections, ttl_dns_cache=60)
    plain = _session(connector, [])
    # Request tracing cost ~8% of a call; only calls under a sliding window need to know when
    # they left, so they go through a sibling session on the same pool that traces (`call`).
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    _TRACED[plain] = _session(connector, [trace], owner=False)
    return plain


_TRACED: weakref.WeakKeyDictionary[aiohttp.ClientSession, aiohttp.ClientSession] = \
    weakref.WeakKeyDictionary()


def _session(connector: aiohttp.TCPConnector, traces: list[aiohttp.TraceConfig],
             owner: bool = True) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=connector, connector_owner=owner, trace_configs=traces,
        cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False,
        # The caller's Content-Type, or none: aiohttp would add application/octet-stream.
        skip_auto_headers=("Content-Type",))


async def _headers_sent(_: aiohttp.ClientSession, ctx: Any, __: Any) -> None:
    """The moment a call leaves (its request headers are written): the rate limiter's
    sliding window is kept to it (app/ratelimit/sent.py)."""
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx()


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    url: str  # the endpoint's URL as registered when the task was claimed (EndpointConfig.call_url)
    headers: str  # JSON as stored
    query: str
    body: str
    allowed: frozenset[str] = DEFAULT_FORWARD  # header names it may carry (lower case)
    cost_from: str | None = None  # where its real cost is read (EndpointSettings.cost_from)


@dataclass(frozen=True, slots=True)
class Outcome:
    status_code: int | None  # None: no response (timeout, connection error)
    text: str
    retry_after_s: float | None = None
    refused: bool = False  # an answer we will not keep (too large): failed, not retried
    pause_s: float | None = None  # the upstream asks the whole endpoint to pause (signals.py)
    cost: int | None = None  # the call's real cost, read through cost_from (None = unknown)

    @property
    def ok(self) -> bool:
        return not self.refused and self.status_code is not None and 200 <= self.status_code < 300

    @property
    def retryable(self) -> bool:
        code = self.status_code
        return not self.refused and (code is None or code == 429 or code >= 500)


async def call(
    client: aiohttp.ClientSession, task_id: str, req: Request, timeout_s: float,
    max_bytes: int, on_sent: Callable[[], None] | None = None,
) -> Outcome:
    """Make one call; `on_sent` runs once its request has left (a client made by
    upstream_client reports that)."""
    if on_sent is not None:
        client = _TRACED.get(client, client)
    headers = forwardable(json.loads(req.headers or "{}"), req.allowed)
    headers.append(("Idempotency-Key", task_id))
    # Stored query parameters come on top of those in the URL (aiohttp merges the two).
    params = [(name, value) for name, values in json.loads(req.query or "{}").items()
              for value in values]
    try:
        async with client.request(
            req.method, req.url, params=params or None, headers=headers,
            data=req.body.encode() if req.body else None, allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),  # the whole call, not per read
            trace_request_ctx=on_sent,
        ) as resp:
            body = await _read(resp, max_bytes)
            if body is None:  # an error answer may be retried; a success would be as large
                busy = resp.status == 429 or resp.status >= 500
                return Outcome(resp.status, f"upstream answer over {max_bytes} bytes: not kept",
                               refused=not busy)
            text = _decode(body, resp.charset)
            pause = pause_s(resp.status, resp.headers)
            after = retry_after(resp.headers.get("retry-after"))
            if pause is not None and resp.status in (429, 503):
                after = pause  # read as the endpoint's pause is: due when it ends, as the probe
            return Outcome(resp.status, text, after, pause_s=pause,
                           cost=real_cost(req.cost_from, resp.headers, text))
    except TimeoutError:
        return Outcome(None, f"upstream timed out after {timeout_s:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome(None, f"upstream unreachable: {type(exc).__name__}: {exc}")
    except ValueError as exc:  # a request that cannot be sent (a control character in a
        # header): it never will be, so it fails at once instead of using up its retries
        return Outcome(None, f"request cannot be sent: {exc}", refused=True)


MAX_COST = 10**12  # a larger "cost" is a misreading, not a cost


def real_cost(cost_from: str | None, headers: Any, text: str) -> int | None:
    """The call's real cost, as `cost_from` says to read it: a header's value, or the number at
    a dot path of the JSON body; None when absent or not a number from 0 to MAX_COST (the
    reservation then stands)."""
    if not cost_from:
        return None
    where, _, name = cost_from.partition(":")
    value: Any = None
    if where == "header":
        value = headers.get(name)
    elif where == "json" and text:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        for part in name.split("."):
            if isinstance(value, dict):
                value = value.get(part)
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                return None
    if isinstance(value, bool) or value is None:
        return None
    try:
        cost = float(value)
    except (TypeError, ValueError):
        return None
    return round(cost) if 0 <= cost <= MAX_COST else None


async def _read(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The body, or None once it passes `max_bytes` (without reading the rest)."""
    if (resp.content_length or 0) > max_bytes:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


def _decode(body: bytes, charset: str | None) -> str:
    """The body as text: its declared charset, else UTF-8; undecodable bytes replaced."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def backoff_s(base_ms: int, attempt: int, retry_after_s: float | None) -> float:
    """Exponential back-off with jitter after `attempt` failed calls; Retry-After wins if longer."""
    ceiling = base_ms / 1000 * 2 ** (attempt - 1)
    delay = random.uniform(ceiling / 2, ceiling)
    return max(delay, retry_after_s or 0.0)
