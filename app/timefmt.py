"""Times on the wire: RFC 3339 UTC with milliseconds; inside: integer ms of the Redis clock."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(ms: int | str | None) -> str | None:
    if ms in (None, ""):
        return None
    dt = datetime.fromtimestamp(int(ms) / 1000, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"
