"""What the sync and the async client share: the status type, errors, the submit body, and
when to retry."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

FINAL = frozenset({"completed", "failed", "cancelled", "expired"})
RETRY_STATUSES = frozenset({429, 503})
LONG_POLL_S = 30.0  # the most `?wait=` holds a request (docs/api.md)
STREAM_READ_S = 45.0  # the stream sends a keep-alive every 15 s: silence this long = broken


class QueueGatewayError(Exception):
    """Base of every error this client raises."""


class ApiError(QueueGatewayError):
    """The gateway answered with an error: `status_code`, `code` (e.g. `endpoint_not_registered`),
    `message` and the rest of the error body in `details`."""

    def __init__(self, status_code: int, code: str, message: str,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code, self.code, self.message = status_code, code, message
        self.details = details or {}


class GatewayUnreachable(QueueGatewayError):
    """No answer from the gateway (connection refused, reset or timed out), after retries."""


class TaskFailed(QueueGatewayError):
    """`result()` of a task that ended `failed`, `cancelled` or `expired`; `status` says how."""

    def __init__(self, status: Status) -> None:
        reason = f": {status.task_result}" if status.task_result else ""
        super().__init__(f"task {status.task_id} {status.task_status}{reason}")
        self.status = status


class WaitTimeout(QueueGatewayError, TimeoutError):
    """`wait()` / `result()` gave up before the task ended; `status` is the last one seen."""

    def __init__(self, status: Status | None, timeout: float) -> None:
        seen = f" (still {status.task_status})" if status else ""
        super().__init__(f"the task did not end within {timeout:g} s{seen}")
        self.status = status


@dataclass(frozen=True)
class Status:
    """A task's status, as `GET /api/v1/tasks/{task_id}` answers it."""

    task_id: str
    task_status: str
    task_type: str = "offline"
    task_result: str | None = None
    wait_num: int = 0
    wait_time: float | None = 0  # None: unknown (its endpoint is paused by an operator)
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    result_status_code: int | None = None
    attempts: int = 0
    permit: dict[str, str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.task_status in FINAL

    @classmethod
    def of(cls, data: dict[str, Any]) -> Status:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "raw"}
        return cls(**known, raw=data)


def submit_body(target_url: str, method: str, body: str, priority: int, task_type: str,
                headers: Mapping[str, str | Sequence[str]] | None,
                query_params: Mapping[str, str | Sequence[str]] | None,
                extra: dict[str, Any]) -> dict[str, Any]:
    return {"target_url": target_url, "http_method": method.upper(), "body": body,
            "priority": priority, "task_type": task_type,
            "timestamp": int(time.time() * 1000),
            "headers": _multi(headers), "query_params": _multi(query_params), **extra}


def _multi(values: Mapping[str, str | Sequence[str]] | None) -> dict[str, list[str]]:
    """The API's multi-value maps: a single string becomes a one-item list."""
    return {k: [v] if isinstance(v, str) else list(v) for k, v in (values or {}).items()}


def make_idempotency_key(given: str | None) -> str:
    """The caller's key, or a new random one: every submit carries one, so repeating it after
    a lost answer cannot make a second task."""
    return given if given is not None else uuid.uuid4().hex


def raise_for_error(r: httpx.Response) -> None:
    if r.is_success:
        return
    try:
        err = r.json()["error"]
        code, message = str(err.get("code", "http_error")), str(err.get("message", ""))
        details = {k: v for k, v in err.items() if k not in ("code", "message")}
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message, details = "http_error", r.text[:200], {}
    raise ApiError(r.status_code, code, message, details)


def retry_after(r: httpx.Response, max_wait: float) -> float | None:
    """Seconds to wait before repeating a request that got 429/503, or None to give up: not
    a retryable status, or a wait longer than `max_wait` (a daily quota resets tomorrow)."""
    if r.status_code not in RETRY_STATUSES:
        return None
    value = r.headers.get("retry-after", "1").strip()
    try:
        wait = float(value)
    except ValueError:
        try:
            wait = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            wait = 1.0
    wait = max(0.0, wait)
    return wait if wait <= max_wait else None


def transport_delay(attempt: int) -> float:
    """Back-off after a connection error: 0.2, 0.4, 0.8 ... up to 5 s."""
    return min(5.0, 0.2 * 2.0 ** attempt)


def sse_status(lines: list[str]) -> Status | None:
    """The status an SSE event carries (its `data:` lines), if it is a status event."""
    kind, data = None, []
    for line in lines:
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if kind != "status" or not data:
        return None
    return Status.of(json.loads("\n".join(data)))


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()
