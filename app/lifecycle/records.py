"""A finished task's fields (from its hash, or a legacy outbox record in JSON) as a
task_results row, and that row back as the fields a task hash has, so status reads both the
same way."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from app.core.keys import endpoint_of

EPOCH = datetime(1970, 1, 1)
#: The fields of a task hash a task_results row is made of.
ROW_FIELDS = ("user_id", "type", "status", "result", "result_status_code", "attempts",
              "created_at", "started_at", "ended_at", "priority", "result_meta")
#: Endings kept for operators, with their request, whether or not their owner read them.
DEAD_LETTERS = frozenset({"failed", "expired"})
#: The fields of a dead letter's hash its `request` keeps, enough to run it again.
REQUEST_FIELDS = ("method", "url", "headers", "query", "body", "score", "cost", "client_ts",
                  "callback_url", "key_id")
MAX_KEPT_BODY = 64 * 1024  # characters of a dead letter's body kept (the rest: cut, marked)


def from_ms(ms: Any) -> datetime | None:
    """Redis-clock milliseconds to a naive UTC datetime, exactly (no float rounding)."""
    if ms in (None, False, ""):
        return None
    return EPOCH + timedelta(milliseconds=int(ms))


def to_ms(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    return str((dt - EPOCH) // timedelta(milliseconds=1))


def _opt_int(v: Any) -> int | None:
    return int(v) if v not in (None, False, "") else None


def _opt_str(v: Any) -> str | None:
    return str(v) if v not in (None, False) else None


def row_of(task_id: str, raw: str) -> dict[str, Any]:
    """A row from a legacy outbox record (JSON); raises ValueError (or KeyError) on a
    malformed one."""
    return row_from(task_id, json.loads(raw))


def row_from(task_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    """A row from a task's fields; raises ValueError (or KeyError) on a malformed record."""
    created = from_ms(rec.get("created_at")) or from_ms(rec.get("ended_at"))
    if created is None:
        raise ValueError("record has no time")
    return {
        "task_id": task_id, "user_id": int(rec["user_id"]), "endpoint": endpoint_of(task_id),
        "type": str(rec["type"]), "status": str(rec["status"]),
        "result": _opt_str(rec.get("result")),
        "result_status_code": _opt_int(rec.get("result_status_code")),
        "attempts": _opt_int(rec.get("attempts")) or 0, "created_at": created,
        "started_at": from_ms(rec.get("started_at")), "ended_at": from_ms(rec.get("ended_at")),
        "priority": _opt_int(rec.get("priority")), "request": _opt_str(rec.get("request")),
        "result_meta": rec.get("result_meta") or None,
    }


def request_of(fields: dict[str, Any], forwarded: frozenset[str] | None) -> str | None:
    """A dead letter's request (REQUEST_FIELDS of its hash) as its row keeps it: JSON, only
    the headers its endpoint forwards (`forwarded`, lower case; None: endpoint gone, none),
    the body cut at MAX_KEPT_BODY (`body_truncated`: it cannot be replayed from SQL)."""
    if fields.get("method") is None:
        return None
    headers = json.loads(fields.get("headers") or "{}")
    kept = {name: values for name, values in headers.items()
            if forwarded is not None and name.lower() in forwarded}
    body = str(fields.get("body") or "")
    out: dict[str, Any] = {
        "method": fields["method"], "url": fields.get("url"), "headers": kept,
        "query": json.loads(fields.get("query") or "{}"), "body": body[:MAX_KEPT_BODY],
        "body_truncated": len(body) > MAX_KEPT_BODY}
    for name in ("score", "cost", "client_ts", "callback_url", "key_id"):
        if fields.get(name) not in (None, ""):
            out[name] = fields[name]
    return json.dumps(out)


def fields_of(row: Any) -> dict[str, str]:
    """A task_results row as the string fields of a task hash (TaskQueue._view reads them)."""
    out = {"status": row.status, "type": row.type, "attempts": str(row.attempts)}
    for name in ("created_at", "started_at", "ended_at"):
        ms = to_ms(getattr(row, name))
        if ms is not None:
            out[name] = ms
    if row.result is not None:
        out["result"] = row.result
    if row.result_status_code is not None:
        out["result_status_code"] = str(row.result_status_code)
    if getattr(row, "priority", None) is not None:
        out["priority"] = str(row.priority)
    if row.result_meta:
        out["result_meta"] = row.result_meta
    return out
