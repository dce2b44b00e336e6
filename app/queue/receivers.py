"""Webhook receivers kept apart: one that hangs must not hold everyone's deliveries.

A receiver that accepts and never answers holds a delivery slot for the whole timeout; with 256
such deliveries due, every slot of the sender went to it, and another user's webhooks came
34 s late. So each receiver (callback scheme, host and port) gets at most `share` of the slots
while it answers, one (a probe) while it fails, and after each timeout or refused connection
it rests, doubling up to MAX_REST_S. A delivery over its receiver's share, or due while it
rests, goes back to the hooks ZSet until then without spending a try (hookretry-2.lua): the
slots stay free for receivers that answer."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FIRST_REST_S, MAX_REST_S = 1.0, 60.0
#: A delivery over its receiver's share waits about this long before it is looked at again
#: (spread, so the ones put back together do not come back together): a little while when
#: the receiver answers (a burst), longer when none of its calls has ended for SLOW_S.
BUSY_WAIT_S, SLOW_WAIT_S = (0.1, 0.4), (2.0, 6.0)
SLOW_S = 1.0


def receiver_of(url: str) -> str:
    """The receiver a callback URL names: its scheme, host and port."""
    parts = urlsplit(url)
    return f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{parts.port or ''}"


@dataclass
class _State:
    in_flight: int = 0
    failures: int = 0  # timeouts and refused connections in a row
    rest_until: float = 0.0  # monotonic
    last_news: float = 0.0  # monotonic: when a call to it last ended, or the first began


@dataclass
class Receivers:
    share: int  # slots one answering receiver may hold
    _by_name: dict[str, _State] = field(default_factory=dict)

    def admit(self, name: str) -> float:
        """0 and the slot is taken, or the seconds the delivery should wait."""
        s = self._by_name.setdefault(name, _State())
        now = time.monotonic()
        if s.rest_until > now:
            return s.rest_until - now + random.uniform(0, 0.5)
        if s.in_flight >= (1 if s.failures else self.share):
            slow = now - s.last_news > SLOW_S
            return random.uniform(*(SLOW_WAIT_S if slow else BUSY_WAIT_S))
        if not s.in_flight:
            s.last_news = now
        s.in_flight += 1
        return 0.0

    def done(self, name: str, unreachable: bool) -> None:
        """A delivery to `name` ended; `unreachable`: it timed out or could not connect."""
        s = self._by_name[name]
        s.in_flight -= 1
        s.last_news = time.monotonic()
        if unreachable:
            s.failures += 1
            rest = min(MAX_REST_S, FIRST_REST_S * 2 ** min(s.failures - 1, 10))
            s.rest_until = time.monotonic() + rest
        else:
            s.failures, s.rest_until = 0, 0.0
        if not s.in_flight and not s.failures:
            del self._by_name[name]  # nothing to remember: keeps the map to live receivers

    def resting(self) -> dict[str, float]:
        """Receivers resting now, and for how many more seconds (for logs and tests)."""
        now = time.monotonic()
        return {n: s.rest_until - now for n, s in self._by_name.items() if s.rest_until > now}
