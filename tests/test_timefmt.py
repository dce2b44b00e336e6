"""Times on the wire: each second's text is formatted once and reused for its milliseconds."""

from __future__ import annotations

from datetime import UTC, datetime

from app.timefmt import rfc3339


def test_rfc3339_matches_the_standard_library_across_seconds_in_any_order() -> None:
    # Forward across a second's end, back to an earlier second, then far ahead: each must be
    # its own second's text, not the one formatted last.
    for ms in (1795659970123, 1795659970999, 1795659971000, 1795659970001, 0,
               "1700000000001", 4102444800000, 1795659971000):
        expected = datetime.fromtimestamp(int(ms) / 1000, UTC).isoformat(timespec="milliseconds")
        assert rfc3339(ms) == expected.replace("+00:00", "Z")
    assert rfc3339(None) is None and rfc3339("") is None
