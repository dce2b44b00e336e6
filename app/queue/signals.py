"""Upstream rate-limit signals: how long an answer asks the whole endpoint to pause.

Read from a 429/503 with `Retry-After`, or from a depleted quota announced in the OpenAI
(`x-ratelimit-remaining-requests: 0` + `x-ratelimit-reset-requests: 1m30s`), Anthropic
(`anthropic-ratelimit-requests-remaining: 0` + `…-reset: <RFC 3339>`) or IETF draft / GitHub
(`ratelimit-remaining` / `x-ratelimit-remaining: 0` + `…-reset: <seconds or epoch>`) forms,
for requests and for tokens alike.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Mapping
from datetime import datetime

MAX_PAUSE_S = 3600.0
MAX_RETRY_AFTER_S = 300.0
#: After the whole second a rounded-up wait ends at: clocks a few ms apart, the call's way there.
ALIGN_MARGIN_S = 0.01
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
#: (remaining, reset) header pairs, lower case.
_PAIRS = [
    (f"{prefix}remaining{suffix}", f"{prefix}reset{suffix}")
    for prefix in ("x-ratelimit-", "ratelimit-")
    for suffix in ("", "-requests", "-tokens")
] + [
    (f"anthropic-ratelimit-{kind}-remaining", f"anthropic-ratelimit-{kind}-reset")
    for kind in ("requests", "tokens", "input-tokens", "output-tokens")
]


def pause_s(status: int, headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the endpoint should admit nothing, or None when the answer asks for no pause.
    `headers` has lower-case names (app/queue/http1.py).

    A wait told in whole seconds (`Retry-After: 1`, `x-ratelimit-reset-requests: 1s`) is rounded
    up: the real one lies in the second below. Taken as it is, each pause overshot the reset by
    half a second on average, and a 1/s window lost a sixth of its calls (bench/upstream_limits.py,
    goodput 0.88); and a 429's `Retry-After: 1` outlasted the precise `250ms` reset beside it.
    So a precise wait within that second is the same wait told better, and otherwise the pause
    ends at the whole second of the clock in it (fixed windows are most often aligned to the
    clock), a little after: an upstream whose windows are not ends up probed early, and its
    answer to the probe pauses the endpoint again."""
    now = time.time() if now is None else now
    told: list[tuple[float, bool]] = []  # (seconds, whole: rounded up to a whole second)
    if status in (429, 503) and (after := retry_after(headers.get("retry-after"), now)) is not None:
        told.append((after, after.is_integer()))
    for remaining, reset in _PAIRS:
        if (headers.get(remaining) or "").strip() == "0":
            wait = reset_s(headers.get(reset), now)
            if wait is not None:
                told.append((wait, _whole(headers.get(reset) or "")))
    if not told:
        return None
    longest = max(_aligned(told, now))
    return min(max(0.0, longest), MAX_PAUSE_S)


def _aligned(told: list[tuple[float, bool]], now: float) -> list[float]:
    """Each wait, a whole-seconds one ending at the second it was rounded up from (pause_s)."""
    precise = [w for w, whole in told if not whole]
    return [w if not whole or w <= 0 else next(
        (p for p in precise if w - 1 < p <= w), math.floor(now + w) - now + ALIGN_MARGIN_S)
        for w, whole in told]


def remaining(headers: Mapping[str, str], now: float | None = None
              ) -> tuple[int, float] | None:
    """How many more calls the upstream said it takes before its reset, and in how many
    seconds that is (aligned as pause_s aligns a pause), from its request-count headers (a
    token count is no count of calls); the smallest count if several limits say. None when
    none says, with a reset we can read."""
    now = time.time() if now is None else now
    told: list[tuple[int, float, bool]] = []
    for name, reset in _PAIRS:
        if "tokens" in name or not _digits(value := (headers.get(name) or "").strip()):
            continue
        wait = reset_s(headers.get(reset), now)
        if wait is not None:
            told.append((int(value), wait, _whole(headers.get(reset) or "")))
    if not told:
        return None
    waits = _aligned([(w, whole) for _, w, whole in told], now)
    count, wait = min(zip((c for c, _, _ in told), waits, strict=True))
    return count, min(max(0.0, wait), MAX_PAUSE_S)


def _digits(value: str) -> bool:
    """ASCII digits only: `str.isdigit` also takes `²` and the like, which int() and float()
    refuse (an upstream's header is latin-1 bytes: `\xb2` is one)."""
    return value.isascii() and value.isdigit()


def _whole(value: str) -> bool:
    """A relative wait in whole seconds (`1`, `1s`, `2m0s`): rounded up, as Retry-After is. A
    unix time or a date is an instant, however coarse."""
    value = value.strip()
    if _digits(value):
        return float(value) <= 1e9
    parts = _GO_DURATION.findall(value)
    return bool(parts) and all(u != "ms" and "." not in n for n, u in parts)


def reset_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds until a reset given as a duration (`20ms`, `1m30.5s`), a number of seconds, a
    unix time, or an RFC 3339 / HTTP date."""
    if not value:
        return None
    value = value.strip()
    now = time.time() if now is None else now
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, number - now) if number > 1e9 else max(0.0, number)
    parts = _GO_DURATION.findall(value)
    if parts and "".join(n + u for n, u in parts) == value:
        return sum(float(n) * _UNIT_S[u] for n, u in parts)
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return retry_after(value, now)  # an HTTP date, or nothing we can read
    return max(0.0, when - now)


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    if _digits(value.strip()):
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    now = time.time() if now is None else now
    return min(max(0.0, when - now), MAX_RETRY_AFTER_S)
