"""Times on the wire: RFC 3339 UTC with milliseconds; inside: integer ms of the Redis clock."""

from __future__ import annotations

from datetime import UTC, datetime

_second: tuple[int, str] = (0, "1970-01-01T00:00:00.")  # the last second formatted


def rfc3339(ms: int | str | None) -> str | None:
    if ms in (None, ""):
        return None
    global _second
    seconds, millis = divmod(int(ms), 1000)
    if seconds != _second[0]:  # strftime was a tenth of a submit's CPU: once a second
        _second = (seconds, datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{_second[1]}{millis:03d}Z"
