"""Calling the business API: headers from an allow-list, the retry policy, the outcome."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from app import __version__, secrets
from app.endpoints import DEFAULT_FORWARD
from app.queue.answers import ResultMeta, external, inline, kept_coding
from app.queue.http1 import Answer, BadAnswer, UpstreamClient
from app.queue.objects import ObjectStore, StoreUnavailable
from app.queue.signals import pause_s, remaining, retry_after

log = logging.getLogger(__name__)
#: What a task's owner (or a proxied caller) reads when the endpoint's credentials cannot be
#: opened here: no endpoint, header name or key id (the operator reads those in the log).
CREDENTIALS_LOST = "upstream credentials unavailable"


def forwardable(headers: dict[str, list[str]], allowed: frozenset[str]) -> list[tuple[str, str]]:
    """The caller's headers whose (lower-case) names are in `allowed`; an allow-list, so a
    header nobody chose to forward (a credential, an identity, an override) never leaves."""
    return [(name, v) for name, values in headers.items() if name.lower() in allowed
            for v in values]


def upstream_client() -> UpstreamClient:
    """The one client for business APIs (app/queue/http1.py says why it is our own). No cookie
    jar: one client serves every caller, and a cookie set by a call for one user must never
    ride along on another's; redirects are not followed: the gateway calls only URLs somebody
    registered."""
    return UpstreamClient(f"queue-gateway/{__version__}")


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    url: str  # the endpoint's URL as registered when the task was claimed (EndpointConfig.call_url)
    headers: str  # JSON as stored
    query: str
    body: str
    allowed: frozenset[str] = DEFAULT_FORWARD  # header names it may carry (lower case)
    cost_from: str | None = None  # where its real cost is read (EndpointSettings.cost_from)
    credentials: secrets.Credentials | None = None  # the endpoint's upstream_headers, sealed


@dataclass(frozen=True, slots=True)
class Outcome:
    status_code: int | None  # None: no response (timeout, connection error)
    text: str  # the task's `result`: the answer as text (or base64), or the gateway's error
    retry_after_s: float | None = None
    refused: bool = False  # an answer we will not keep (too large): failed, not retried
    pause_s: float | None = None  # the upstream asks the whole endpoint to pause (signals.py)
    cost: int | None = None  # the call's real cost, read through cost_from (None = unknown)
    meta: ResultMeta | None = None  # the answer's type, size, encoding (None: no answer kept)
    #: (calls, seconds): how many more the upstream takes before its reset (signals.remaining)
    remaining: tuple[int, float] | None = None
    #: False: its time says nothing of the upstream (the call was never sent, or the answer
    #: came but the result store failed): no latency sample, no refusal (adaptive.lua)
    measured: bool = True

    @property
    def ok(self) -> bool:
        return not self.refused and self.status_code is not None and 200 <= self.status_code < 300

    @property
    def retryable(self) -> bool:
        code = self.status_code
        return not self.refused and (code is None or code == 429 or code >= 500)


@dataclass(frozen=True, slots=True)
class Keeper:
    """Where answers larger than `inline_bytes` go as they arrive: the result store."""

    store: ObjectStore
    inline_bytes: int


async def call(
    client: UpstreamClient, task_id: str, req: Request, timeout_s: float, max_bytes: int,
    on_sent: Callable[[], None] | None = None, keeper: Keeper | None = None,
) -> Outcome:
    """Make one call, bounded by `timeout_s` as a whole (a large answer's upload to the
    result store included); `on_sent` runs once its request has left (the sliding window is
    kept to that moment: app/ratelimit/sent.py)."""
    headers = forwardable(json.loads(req.headers or "{}"), req.allowed)
    try:
        headers = secrets.outgoing(headers, req.credentials)
    except secrets.Undecryptable as exc:  # retried: another process may hold the key
        # The caller reads the result: it learns no endpoint, header name or key id. The
        # operator reads them here.
        log.error("cannot open credentials: %s", exc, extra={"task_id": task_id})
        return Outcome(None, CREDENTIALS_LOST, measured=False)
    headers.append(("Idempotency-Key", task_id))
    # Stored query parameters come on top of those in the URL.
    params = [(name, value) for name, values in json.loads(req.query or "{}").items()
              for value in values]
    storing = _Storing()
    try:
        async with asyncio.timeout(timeout_s):
            answer = await client.request(
                req.method, req.url, params, headers,
                req.body.encode() if req.body else None, max_bytes, on_sent,
                keeper.inline_bytes if keeper else None)
            if answer.stream is not None and keeper is not None:
                return await _stored(keeper, task_id, answer, max_bytes, req.cost_from,
                                     storing)
    except TimeoutError:
        if storing.on_store:  # the upstream had given what was asked of it: not its fault
            return Outcome(None, f"result_store_unavailable: the store took the call past "
                           f"its {timeout_s:g} s", measured=False)
        return Outcome(None, f"upstream timed out after {timeout_s:g} s")
    except BadAnswer as exc:
        return Outcome(None, f"upstream answer unreadable: {exc}")
    except OSError as exc:
        return Outcome(None, f"upstream unreachable: {type(exc).__name__}: {exc}")
    except StoreUnavailable as exc:  # the answer came but could not be kept: tried again
        return Outcome(None, f"result_store_unavailable: {exc}", measured=False)
    except ValueError as exc:  # a request that cannot be sent (a control character in a
        # header): it never will be, so it fails at once instead of using up its retries
        return Outcome(None, f"request cannot be sent: {exc}", refused=True, measured=False)
    status, got = answer.status, answer.headers
    if answer.body is None:  # an error answer may be retried; a success would be as large
        busy = status == 429 or status >= 500
        return Outcome(status, f"upstream answer over {max_bytes} bytes: not kept",
                       refused=not busy)
    text, meta = inline(unechoed(answer.body, status, req.credentials), got)
    pause = pause_s(status, got)
    after = retry_after(got.get("retry-after"))
    if pause is not None and status in (429, 503):
        after = pause  # read as the endpoint's pause is: due when it ends, as the probe
    return Outcome(status, text, after, pause_s=pause,
                   cost=real_cost(req.cost_from, got, text if not meta.encoding else ""),
                   meta=meta, remaining=remaining(got))


def unechoed(body: bytes, status: int, credentials: secrets.Credentials | None) -> bytes:
    """An error answer without the endpoint's credentials it may echo back (a 401 saying "key
    sk-... is not valid"): whoever reads the task never holds them. A success stays byte for
    byte as sent."""
    if 200 <= status < 300:
        return body
    echoed = secrets.echoes(credentials)
    return secrets.hide(body, echoed) if echoed else body


@dataclass(slots=True)
class _Storing:
    """Whose turn it is while a large answer streams into the store: a call that runs out of
    time waiting on the store is the store's failure, not the upstream's."""

    on_store: bool = False


async def _stored(keeper: Keeper, task_id: str, answer: Answer, max_bytes: int,
                  cost_from: str | None, storing: _Storing) -> Outcome:
    """Stream a large answer into the result store; the task keeps its key. An error answer
    this large is not kept (its status and signals are)."""
    stream, status, got = answer.stream, answer.status, answer.headers
    assert stream is not None
    size, over = 0, False

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal size, over
        pieces = aiter(stream)
        while True:
            storing.on_store = False  # waiting for the upstream's next piece
            try:
                chunk = await anext(pieces)
            except StopAsyncIteration:
                storing.on_store = True  # the upload's completion is the store's
                return
            storing.on_store = True
            size += len(chunk)
            if size > max_bytes:
                over = True
                raise StoreRefused(f"over {max_bytes} bytes")
            yield chunk

    try:
        if not 200 <= status < 300:
            return _answered(status, got, f"upstream answer of status {status} over "
                             f"{keeper.inline_bytes} bytes: not kept", None, "")
        key = keeper.store.new_key(task_id)
        storing.on_store = True  # its upload begins with a request of the store's
        try:
            await keeper.store.put(key, chunks(), got.get("content-type"), kept_coding(got))
        except Exception:
            if over:  # the partial object is gone (ObjectStore.put); never retried
                return Outcome(status, f"upstream answer over {max_bytes} bytes "
                               "(QGW_MAX_RESULT_BYTES): not kept", refused=True)
            raise
    finally:
        stream.close()
    return _answered(status, got, "", external(key, size, got), cost_from)


class StoreRefused(Exception):
    """The answer outgrew what may be kept while it was being stored."""


def _answered(status: int, got: dict[str, str], text: str, meta: ResultMeta | None,
              cost_from: str | None) -> Outcome:
    pause = pause_s(status, got)
    after = retry_after(got.get("retry-after"))
    if pause is not None and status in (429, 503):
        after = pause
    return Outcome(status, text, after, pause_s=pause,
                   cost=real_cost(cost_from, got, ""), meta=meta, remaining=remaining(got))


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
        value = headers.get(name.lower())
    elif where == "json" and text:
        try:
            value = at_path(json.loads(text), name.split("."))
        except (ValueError, RecursionError):  # an answer nested thousands deep is no cost
            return None
    if isinstance(value, bool) or value is None:
        return None
    try:
        cost = float(value)
    except (TypeError, ValueError, OverflowError):  # a 400-digit integer too
        return None
    return round(cost) if 0 <= cost <= MAX_COST else None


def at_path(value: Any, path: list[str]) -> Any:
    """What a dotted path's parts name in parsed JSON (object keys, array indexes); None where
    the path leads nowhere."""
    for part in path:
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isascii() and part.isdigit() \
                and int(part) < len(value):  # not `²`, a digit int() refuses
            value = value[int(part)]
        else:
            return None
    return value


def backoff_s(base_ms: int, attempt: int, retry_after_s: float | None) -> float:
    """Exponential back-off with jitter after `attempt` failed calls; Retry-After wins if longer."""
    ceiling = base_ms / 1000 * 2 ** (attempt - 1)
    delay = random.uniform(ceiling / 2, ceiling)
    return max(delay, retry_after_s or 0.0)
