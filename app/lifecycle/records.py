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
              "created_at", "started_at", "ended_at", "result_meta")


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
        "result_meta": rec.get("result_meta") or None,
    }


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
    if row.result_meta:
        out["result_meta"] = row.result_meta
    return out
