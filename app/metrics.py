"""Prometheus metrics: per-endpoint numbers from Redis, submit latency from this process.

Counters and the queue-wait and upstream-latency histograms are kept in Redis by the scripts
(app/queue/stats.py), so they are exact across every API and dispatcher process; a scrape reads
them for all endpoints in one pipeline and writes them out as one snapshot.  Submit latency is
this API process's own: a prometheus-client Histogram, with the default process metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY, Histogram, generate_latest
from redis.exceptions import RedisError

from app.queue.stats import BOUNDS_MS, COUNTERS, EndpointStats

SUBMIT_LATENCY = Histogram(
    "qgw_submit_latency_seconds", "Time to accept a task (POST /api/v1/tasks answered 202), "
    "in this API process", ["endpoint"],
    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
_LE = [*(f"{b / 1000:g}" for b in BOUNDS_MS), "+Inf"]
_HELP = {
    "submitted": "Tasks accepted into the queue",
    "admitted": "Claims (a task retried or handed back is claimed again)",
    "completed": "Tasks completed", "failed": "Tasks failed for good",
    "retried": "Attempts made again (upstream error or an expired lease)",
    "expired": "Tasks that expired (pending past their TTL, or an unused online permit)",
    "cancelled": "Tasks cancelled by their owner",
    "limited": "Claim attempts the rate limiter deferred",
}


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def render_snapshot(snapshot: list[EndpointStats]) -> str:
    """The exposition text of one scrape's snapshot, written directly: prometheus-client's
    generic collector path took 350 ms for 1,000 endpoints (48,000 samples), this about a
    tenth.  Endpoint ids need no escaping in a label value (app/models.py ENDPOINT_ID)."""
    out: list[str] = []
    gauges: tuple[tuple[str, str, Callable[[EndpointStats], float | None]], ...] = (
        ("qgw_queue_pending", "Tasks waiting in line", lambda s: s.pending),
        ("qgw_queue_in_flight", "Tasks admitted and not finished", lambda s: s.in_flight),
        ("qgw_estimated_wait_seconds", "Estimated wait of a task submitted now",
         lambda s: s.wait_for_new_s()),
        ("qgw_slot_seconds", "Moving average of how long a task holds a concurrency slot",
         lambda s: None if s.slot_ms is None else s.slot_ms / 1000),
        ("qgw_endpoint_upstream_paused", "1 while the upstream's own limit pauses the endpoint "
         "(until the time below, then until a probe call succeeds)",
         lambda s: int(s.upstream_paused_until is not None)),
        ("qgw_endpoint_upstream_paused_until_seconds", "Until when the upstream asked for the "
         "pause (unix time)",
         lambda s: None if s.upstream_paused_until is None else s.upstream_paused_until / 1000),
    )
    for name, help_text, get in gauges:
        _family(out, name, "gauge", help_text)
        for s in snapshot:
            if (v := get(s)) is not None:
                out.append(f'{name}{{endpoint="{s.id}"}} {_num(v)}\n')
    for c in COUNTERS:
        name = f"qgw_tasks_{c}_total"
        _family(out, name, "counter", _HELP[c])
        out.extend(f'{name}{{endpoint="{s.id}"}} {s.counters[c]}\n' for s in snapshot)
    for key, name, help_text in (
        ("queue_wait_ms", "qgw_queue_wait_seconds", "Time from submit to first start"),
        ("upstream_ms", "qgw_upstream_latency_seconds", "Duration of successful upstream calls"),
    ):
        _family(out, name, "histogram", help_text)
        for s in snapshot:
            h = s.histograms[key]
            out.extend(f'{name}_bucket{{endpoint="{s.id}",le="{le}"}} {v}\n'
                       for le, v in zip(_LE, h.cumulative, strict=True))
            out.append(f'{name}_count{{endpoint="{s.id}"}} {h.count}\n')
            out.append(f'{name}_sum{{endpoint="{s.id}"}} {_num(h.sum_ms / 1000)}\n')
    return "".join(out)


def render(snapshot: list[EndpointStats] | None) -> bytes:
    """The exposition text: this process's metrics (prometheus-client), then the queues, or
    with Redis unreachable (None) only this process's and `qgw_redis_up 0`: a scrape that
    failed would lose this process's own numbers just when they matter."""
    up = ("# HELP qgw_redis_up Whether this process could read the queues from Redis\n"
          f"# TYPE qgw_redis_up gauge\nqgw_redis_up {0 if snapshot is None else 1}\n")
    queues = render_snapshot(snapshot) if snapshot is not None else ""
    return generate_latest(REGISTRY) + (up + queues).encode()


class SharedScrape:
    """Scrapes that arrive while one is reading Redis share its answer: n scrapers (several
    Prometheus servers, an impatient loop) cost one read of every endpoint, not n."""

    def __init__(self) -> None:
        self._running: asyncio.Future[bytes] | None = None

    async def text(self, read: Callable[[], Awaitable[list[EndpointStats]]]) -> bytes:
        if self._running is None:
            self._running = asyncio.ensure_future(self._read(read))
            self._running.add_done_callback(self._forget)
        return await asyncio.shield(self._running)

    def _forget(self, _: asyncio.Future[bytes]) -> None:
        self._running = None

    @staticmethod
    async def _read(read: Callable[[], Awaitable[list[EndpointStats]]]) -> bytes:
        try:
            snapshot: list[EndpointStats] | None = await read()
        except (RedisError, OSError):
            snapshot = None
        return render(snapshot)
