"""Prometheus metrics: per-endpoint numbers from Redis, submit latency from this process.

Counters and the queue-wait and upstream-latency histograms are kept in Redis by the scripts
(app/queue/stats.py), so they are exact across every API and dispatcher process; a scrape reads
them for all endpoints in one pipeline and writes them out as one snapshot.  Submit latency and
HTTP requests by route are this API process's own, with the default process metrics.
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import REGISTRY, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from redis.exceptions import RedisError

from app import __version__
from app.queue.stats import (
    BOUNDS_MS,
    COUNTERS,
    FAIL_CLASSES,
    HOOK_OUTCOMES,
    EndpointStats,
    Snapshot,
    binding_limit,
    possible_limits,
)

SUBMIT_LATENCY = Histogram(
    "qgw_submit_latency_seconds", "Time to accept a task (POST /api/v1/tasks answered 202), "
    "in this API process", ["endpoint"],
    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
SUBMIT_REJECTED = PromCounter(
    "qgw_submit_rejections", "Submits this API process refused, by the error code it answered "
    "(invalid_request, quota_exceeded, endpoint_not_registered ...)", ["reason"])
_LE = [*(f"{b / 1000:g}" for b in BOUNDS_MS), "+Inf"]
DATABASE_CHECK_EVERY_S = 5.0  # a scrape reuses a database check (its own or /readyz's) this new
_HELP = {
    "submitted": "Tasks accepted into the queue",
    "admitted": "Admissions: a task claimed for a call (one retried or handed back is "
                "admitted again, so this can exceed the tasks submitted)",
    "completed": "Tasks completed", "failed": "Tasks failed for good",
    "retried": "Attempts made again (upstream error or an expired lease)",
    "expired": "Tasks that expired (pending past their TTL, or an unused online permit)",
    "cancelled": "Tasks cancelled by their owner",
    "limited": "Claim attempts a limit deferred (a task is tried again each time its limit "
               "admits: this counts attempts, not tasks)",
}
#: The counter names: every one counts tasks but `limited`, which counts claim attempts.
_COUNTER_NAMES = {c: f"qgw_tasks_{c}_total" for c in COUNTERS} | {
    "limited": "qgw_claim_attempts_limited_total"}
_HOOK_HELP = {"delivered": "Webhooks a receiver accepted (2xx)",
              "retried": "Webhook deliveries that failed and will be tried again",
              "given_up": "Webhooks given up (an hour of failures, or their key revoked)"}


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _endpoint_gauges(now_ms: int) -> tuple[tuple[str, str, Callable[[EndpointStats],
                                                                     float | None]], ...]:
    return (
        ("qgw_queue_pending", "Tasks waiting in line", lambda s: s.pending),
        ("qgw_queue_in_flight", "Tasks admitted and not finished", lambda s: s.in_flight),
        ("qgw_outbox_backlog", "Finished tasks whose SQL row is not written yet",
         lambda s: s.outbox),
        ("qgw_oldest_pending_age_seconds", "How long the task waiting longest has waited",
         lambda s: None if s.oldest_pending_ms is None
         else max(0, now_ms - s.oldest_pending_ms) / 1000),
        ("qgw_estimated_wait_seconds", "Estimated wait of a task submitted now",
         lambda s: s.wait_for_new_s(now_ms)),
        ("qgw_slot_seconds", "Moving average of how long a task holds a concurrency slot",
         lambda s: None if s.slot_ms is None else s.slot_ms / 1000),
        ("qgw_endpoint_max_concurrency", "Configured cap on tasks in flight",
         lambda s: s.endpoint.max_concurrency),
        ("qgw_endpoint_adaptive_limit", "The cap an adaptive endpoint has learnt (absent when "
         "its cap is fixed)", lambda s: s.adaptive_limit),
        ("qgw_endpoint_rate_limit_per_second", "Configured admissions a second (rate over "
         "interval; absent when unlimited)",
         lambda s: s.endpoint.rate * 1000 / s.endpoint.interval_ms if s.endpoint.rate else None),
        ("qgw_endpoint_paused", "1 while an operator has paused dispatch (submits still "
         "accepted)", lambda s: int(s.endpoint.paused)),
        ("qgw_webhooks_pending", "Webhooks due or being retried (given up an hour after their "
         "task ended)", lambda s: s.hooks),
        ("qgw_endpoint_upstream_paused", "1 while the upstream's own limit pauses the endpoint "
         "(until the time below, then until a probe call succeeds)",
         lambda s: int(s.upstream_paused_until is not None)),
        ("qgw_endpoint_upstream_paused_until_timestamp_seconds", "Until when the upstream "
         "asked for the pause (unix time)",
         lambda s: None if s.upstream_paused_until is None else s.upstream_paused_until / 1000),
    )


def _binding_limits(out: list[str], snapshot: Snapshot) -> None:
    """Which limit holds each endpoint's line now and when it admits next: the admin view's
    `binding_limit` and `admits_next_at`, from the same read."""
    now, bound = snapshot.now_ms, [(s, *binding_limit(s, snapshot.now_ms))
                                   for s in snapshot.endpoints]
    name = "qgw_endpoint_limited"
    _family(out, name, "gauge", "1 for the limit holding the endpoint's line now (paused, "
            "upstream, rate, limits: <rate>/<interval>ms per <request|cost>, concurrency), 0 "
            "for the others it has")
    for s, binding, _ in bound:
        names = possible_limits(s.endpoint)
        if binding is not None and binding not in names:  # e.g. a limit just reconfigured
            names.append(binding)
        out.extend(f'{name}{{endpoint="{s.id}",limit="{n}"}} {int(n == binding)}\n'
                   for n in names)
    name = "qgw_endpoint_admits_next_seconds"
    _family(out, name, "gauge", "Seconds until the limit holding the line admits again "
            "(absent when nothing holds it for a known time)")
    out.extend(f'{name}{{endpoint="{s.id}"}} {_num(max(0, at - now) / 1000)}\n'
               for s, _, at in bound if at is not None)


def render_snapshot(snapshot: Snapshot) -> str:
    """The exposition text of one scrape's snapshot, written directly: prometheus-client's
    generic collector path took 350 ms for 1,000 endpoints (48,000 samples), this about a
    tenth.  Endpoint ids need no escaping in a label value (app/models.py ENDPOINT_ID)."""
    out: list[str] = []
    eps, d = snapshot.endpoints, snapshot.dispatchers
    for name, help_text, n in (
        ("qgw_dispatchers_alive", "Dispatchers seen in the last 10 s", d.alive),
        ("qgw_dispatchers_in_flight", "Calls running in the dispatchers alive", d.in_flight),
    ):
        _family(out, name, "gauge", help_text)
        out.append(f"{name} {n}\n")
    for name, help_text, get in _endpoint_gauges(snapshot.now_ms):
        _family(out, name, "gauge", help_text)
        for s in eps:
            if (v := get(s)) is not None:
                out.append(f'{name}{{endpoint="{s.id}"}} {_num(v)}\n')
    _binding_limits(out, snapshot)
    for c in COUNTERS:
        name = _COUNTER_NAMES[c]
        _family(out, name, "counter", _HELP[c])
        out.extend(f'{name}{{endpoint="{s.id}"}} {s.counters[c]}\n' for s in eps)
    for outcome in HOOK_OUTCOMES:
        name, field = f"qgw_webhooks_{outcome}_total", f"hooks_{outcome}"
        _family(out, name, "counter", _HOOK_HELP[outcome])
        out.extend(f'{name}{{endpoint="{s.id}"}} {s.raw.get(field, 0)}\n' for s in eps)
    name = "qgw_upstream_failures_total"
    _family(out, name, "counter", "Upstream calls that failed (retried or for good), by the "
            "class of their HTTP status; none = no answer (timeout, connection error)")
    for s in eps:
        failed = s.failed_calls
        out.extend(f'{name}{{endpoint="{s.id}",class="{c}"}} {failed[c]}\n'
                   for c in FAIL_CLASSES)
    for key, name, help_text in (
        ("queue_wait_ms", "qgw_queue_wait_seconds", "Time from submit to first start"),
        ("upstream_ms", "qgw_upstream_latency_seconds", "Duration of successful upstream calls"),
        ("upstream_failed_ms", "qgw_upstream_failed_latency_seconds",
         "Duration of failed upstream calls (retried or for good)"),
    ):
        _family(out, name, "histogram", help_text)
        for s in eps:
            h = s.histograms[key]
            out.extend(f'{name}_bucket{{endpoint="{s.id}",le="{le}"}} {v}\n'
                       for le, v in zip(_LE, h.cumulative, strict=True))
            out.append(f'{name}_count{{endpoint="{s.id}"}} {h.count}\n')
            out.append(f'{name}_sum{{endpoint="{s.id}"}} {_num(h.sum_ms / 1000)}\n')
    return "".join(out)


def _process(database_up: bool, http: Counter[tuple[str, str, int]]) -> list[str]:
    """This process's own lines: build, database and HTTP requests."""
    out: list[str] = []
    _family(out, "qgw_build_info", "gauge", "The running version (always 1)")
    out.append(f'qgw_build_info{{version="{__version__}",'
               f'python="{platform.python_version()}"}} 1\n')
    _family(out, "qgw_database_up", "gauge", "Whether the database answered SELECT 1 within "
            f"0.5 s (checked at most every {DATABASE_CHECK_EVERY_S:g} s)")
    out.append(f"qgw_database_up {int(database_up)}\n")
    _family(out, "qgw_http_requests_total", "counter",
            "HTTP requests this API process answered, by route template, method and status")
    out.extend(f'qgw_http_requests_total{{route="{route}",method="{method}",code="{code}"}} '
               f"{n}\n" for (route, method, code), n in sorted(http.items()))
    return out


def render(snapshot: Snapshot | None, database_up: bool = False,
           http: Counter[tuple[str, str, int]] | None = None) -> bytes:
    """The exposition text: this process's metrics, then the queues, or with Redis
    unreachable (None) only this process's and `qgw_redis_up 0`: a scrape that failed would
    lose this process's own numbers just when they matter."""
    up = ("# HELP qgw_redis_up Whether this process could read the queues from Redis\n"
          f"# TYPE qgw_redis_up gauge\nqgw_redis_up {0 if snapshot is None else 1}\n")
    queues = render_snapshot(snapshot) if snapshot is not None else ""
    own = "".join(_process(database_up, http or Counter()))
    return generate_latest(REGISTRY) + (own + up + queues).encode()


class DatabaseUp:
    """Whether the database answered lately: /readyz's check, or a scrape's own (bounded) when
    the last one is older than DATABASE_CHECK_EVERY_S, so scrapes add no load on it."""

    def __init__(self) -> None:
        self._up, self._at = False, float("-inf")

    def record(self, up: bool) -> None:
        self._up, self._at = up, time.monotonic()

    async def check(self, probe: Callable[[], Awaitable[Any]]) -> bool:
        if time.monotonic() - self._at >= DATABASE_CHECK_EVERY_S:
            try:
                await probe()
                self.record(True)
            except Exception:  # down, refusing, timed out: all the same to a gauge
                self.record(False)
        return self._up


class SharedScrape:
    """Scrapes that arrive while one is reading Redis share its answer: n scrapers (several
    Prometheus servers, an impatient loop) cost one read of every endpoint, not n.  Holds this
    process's HTTP request counts (HttpRequests) and its last database check too."""

    def __init__(self) -> None:
        self._running: asyncio.Future[bytes] | None = None
        self.http: Counter[tuple[str, str, int]] = Counter()
        self.database = DatabaseUp()

    async def text(self, read: Callable[[], Awaitable[Snapshot]],
                   database: Callable[[], Awaitable[Any]]) -> bytes:
        if self._running is None:
            self._running = asyncio.ensure_future(self._read(read, database))
            self._running.add_done_callback(self._forget)
        return await asyncio.shield(self._running)

    def _forget(self, _: asyncio.Future[bytes]) -> None:
        self._running = None

    async def _read(self, read: Callable[[], Awaitable[Snapshot]],
                    database: Callable[[], Awaitable[Any]]) -> bytes:
        async def snapshot() -> Snapshot | None:
            try:
                return await read()
            except (RedisError, OSError):
                return None

        queues, db_up = await asyncio.gather(snapshot(), self.database.check(database))
        return render(queues, db_up, self.http)


class HttpRequests:
    """Pure ASGI middleware counting answers by route template, method and status into a
    Counter: one increment a request, the route read from what the router already matched
    (no path regex of our own), since the submit path is hot."""

    def __init__(self, app: Any, counts: Counter[tuple[str, str, int]]) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers if the app raises before it starts a response

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.counts[(route, scope["method"], status)] += 1
