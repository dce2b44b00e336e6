"""Per-endpoint numbers for /metrics, the admin view and the dashboard: one pipeline for every
endpoint, no key scans.

The counters, histograms and moving averages live in each endpoint's stats hash, kept by the
Lua scripts that make the transitions (lua/includes/stats.lua), so they are exact and shared by
every API and dispatcher process.  Depth and in flight are the queue's and active set's ZCARD.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from app.core.clock import queue_time
from app.core.keys import Keys
from app.core.scripts import LUA_DIR, Scripts
from app.endpoints import EndpointConfig
from app.queue.presence import Dispatchers, tally
from app.queue.tasks import MEASURED_FIELDS, current_cap, estimate_wait
from app.timefmt import rfc3339

COUNTERS = ("submitted", "admitted", "completed", "failed", "retried", "expired", "cancelled",
            "limited")
HOOK_OUTCOMES = ("delivered", "retried", "given_up")  # fields hooks_<outcome> (webhooks.py)
HISTOGRAMS = ("queue_wait_ms", "upstream_ms", "upstream_failed_ms")
FAIL_CLASSES = ("2xx", "3xx", "4xx", "5xx", "none")  # fields fail_<class>, stats_call_failed
AVERAGES = ("exec_ms", "slot_ms")
OLDEST_BANDS = 64  # priority bands the oldest-pending lookup visits (lua/oldest-1.lua)


def _lua_constants() -> tuple[tuple[int, ...], int, int, int]:
    """Bucket bounds and ring sizes, read from the script include so the two never disagree."""
    text = (LUA_DIR / "includes" / "stats.lua").read_text()
    bounds = re.search(r"STATS_BOUNDS_MS = \{([\d, ]+)\}", text)
    sizes = re.search(r"RING_MS, RING_SLOTS, FAIL_KEEP = (\d+), (\d+), (\d+)", text)
    assert bounds and sizes, "lua/includes/stats.lua lost its constants"
    ring_ms, slots, keep = (int(g) for g in sizes.groups())
    return tuple(int(b) for b in bounds.group(1).split(",")), ring_ms, slots, keep


BOUNDS_MS, RING_MS, RING_SLOTS, FAIL_KEEP = _lua_constants()
_BUCKETS = [*(str(b) for b in BOUNDS_MS), "inf"]


@dataclass
class Histogram:
    cumulative: list[int]  # per bound in BOUNDS_MS, then +Inf (= count)
    sum_ms: int

    @property
    def count(self) -> int:
        return self.cumulative[-1]


@dataclass
class EndpointStats:
    endpoint: EndpointConfig
    pending: int
    in_flight: int
    counters: dict[str, int]
    exec_ms: float | None
    slot_ms: float | None
    histograms: dict[str, Histogram]
    oldest_pending_ms: int | None = None  # creation time of the longest-waiting task, if known
    upstream_paused_until: int | None = None  # ms; set until a probe call succeeds
    hooks: int = 0  # webhooks due or being retried (app/queue/webhooks.py)
    outbox: int = 0  # finished tasks whose SQL row is not written yet
    raw: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def adaptive_limit(self) -> int | None:
        """The cap an adaptive endpoint admits to now (lua/includes/adaptive.lua); None when
        its cap is fixed."""
        if self.endpoint.concurrency != "adaptive":
            return None
        return current_cap(self.endpoint, self.raw.get("alimit"))

    @property
    def failed_calls(self) -> dict[str, int]:
        """Failed upstream calls (retried or final) by the class of the upstream's status."""
        return {c: int(self.raw.get(f"fail_{c}", 0)) for c in FAIL_CLASSES}

    def wait_for_new_s(self, now_ms: int) -> float:
        """The estimate a task submitted now would get (app/queue/tasks.py estimate_wait), from
        the same stats fields the submit reads: the head's limiter state and the average cost
        too, so the admin view, /metrics and the answers agree."""
        m = [self.raw.get(f) for f in MEASURED_FIELDS]
        return estimate_wait(self.endpoint, self.pending,
                             [m[0], m[1], self.in_flight, m[2], m[3], now_ms, *m[4:]])


def _parse(ep: EndpointConfig, pending: int, in_flight: int, raw: dict[str, str]
           ) -> EndpointStats:
    histograms = {}
    for h in HISTOGRAMS:
        running, cumulative = 0, []
        for b in _BUCKETS:
            running += int(raw.get(f"{h}:{b}", 0))
            cumulative.append(running)
        histograms[h] = Histogram(cumulative, int(raw.get(f"{h}:sum", 0)))
    avg = {a: float(v) if (v := raw.get(a)) else None for a in AVERAGES}
    paused = raw.get("upause") if ep.honor_upstream_limits else None  # else it holds nothing
    return EndpointStats(ep, pending, in_flight, {c: int(raw.get(c, 0)) for c in COUNTERS},
                         avg["exec_ms"], avg["slot_ms"], histograms, raw=raw,
                         upstream_paused_until=int(paused) if paused else None)


@dataclass
class Snapshot:
    """What one scrape read: every endpoint, and the dispatchers seen alive."""
    endpoints: list[EndpointStats]
    dispatchers: Dispatchers
    now_ms: int  # Redis clock


async def read_metrics(redis: Redis, keys: Keys, scripts: Scripts,
                       endpoints: list[EndpointConfig]) -> Snapshot:
    """What /metrics shows, for every endpoint in one round trip (5 commands an endpoint, 2
    in all)."""
    for attempt in (1, 2):
        async with redis.pipeline(transaction=False) as pipe:
            queue_time(pipe, keys.dispatchers)
            pipe.hgetall(keys.dispatchers)
            for ep in endpoints:
                pipe.zcard(keys.queue(ep.id))
                pipe.zcard(keys.active(ep.id))
                # HGETALL, not HMGET of the fields: naming 44 fields per endpoint made encoding
                # the pipeline most of a scrape's cost; absent buckets are simply not sent.
                pipe.hgetall(keys.stats(ep.id))
                pipe.zcard(keys.outbox(ep.id))
                pipe.zcard(keys.hooks(ep.id))
                scripts.oldest.queue_on(pipe, [keys.queue(ep.id)], [OLDEST_BANDS])
            raw = await pipe.execute(raise_on_error=False)
        if attempt == 1 and any(isinstance(r, NoScriptError) for r in raw):
            await scripts.oldest.load()  # Redis restarted (or flushed its scripts)
            continue
        break
    if errors := [r for r in raw if isinstance(r, Exception)]:
        raise errors[0]
    now = int(raw[0][0]) * 1000 + int(raw[0][1]) // 1000
    dispatchers = tally(raw[1], now)
    if dispatchers.stale:  # crashed or stuck: rare, so a second trip is fine then
        await redis.hdel(keys.dispatchers, *dispatchers.stale)
    out = []
    for i, ep in enumerate(endpoints):
        pending, in_flight, values, outbox, hooks, oldest = raw[2 + i * 6:8 + i * 6]
        s = _parse(ep, pending, in_flight, values)
        s.outbox, s.hooks, s.oldest_pending_ms = outbox, hooks, _id_ms(oldest) if oldest else None
        out.append(s)
    return Snapshot(out, dispatchers, now)


def _id_ms(task_id: str) -> int:
    """Creation time of a task id (UUIDv7: the first 48 bits are unix ms, app/queue/ids.py)."""
    return int(task_id[:12], 16)


async def queue_stats(redis: Redis, keys: Keys, scripts: Scripts,
                      endpoints: list[EndpointConfig]) -> list[Any]:
    """The admin view (and the dashboard's data): exact counts, recent rates, the estimate for
    a new task, the oldest pending age and the last failures, in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        queue_time(pipe, keys.dispatchers)
        for ep in endpoints:
            e = ep.id
            pipe.zcard(keys.queue(e))
            pipe.zcard(keys.active(e))
            pipe.hgetall(keys.stats(e))
            await scripts.oldest(keys=[keys.queue(e)], args=[OLDEST_BANDS], client=pipe)
            if ep.limiter == "sliding_window":  # counted back from the Redis clock
                await scripts.recent(keys=[keys.ratelimit(e, ep.limiter)], args=[ep.interval_ms],
                                     client=pipe)
            else:
                pipe.exists(keys.ratelimit(e, ep.limiter))  # keeps the stride
        raw = await pipe.execute()
    now_s, now_us = raw[0]
    now = int(now_s) * 1000 + int(now_us) // 1000
    out = []
    for i, ep in enumerate(endpoints):
        pending, in_flight, values, oldest_id, admitted = raw[1 + i * 5:6 + i * 5]
        s = _parse(ep, pending, in_flight, values)
        oldest = _id_ms(oldest_id) if oldest_id else None
        out.append(_view(s, now, oldest, admitted if ep.limiter == "sliding_window" else None))
    return out


def _rate(raw: dict[str, str], ring: str, now: int) -> float:
    """Events a second over the last minute, from the 10-second ring (stats.lua stats_tick)."""
    current = now // RING_MS
    window_slots = 60_000 // RING_MS
    total = 0
    for i in range(RING_SLOTS):
        t = raw.get(f"{ring}:t{i}")
        if t is not None and current - window_slots <= int(t) <= current:
            total += int(raw.get(f"{ring}:{i}", 0))
    span_ms = window_slots * RING_MS + now % RING_MS
    return round(total / (span_ms / 1000), 3)


def _failures(raw: dict[str, str]) -> list[dict[str, Any]]:
    items = [json.loads(v) for i in range(FAIL_KEEP) if (v := raw.get(f"fail:{i}"))]
    return sorted(items, key=lambda f: -int(f["at"]))


def _view(s: EndpointStats, now: int, oldest: int | None, admitted: int | None
          ) -> dict[str, Any]:
    ep = s.endpoint
    qw = s.histograms["queue_wait_ms"]
    return {
        "id": ep.id, "pending": s.pending, "in_flight": s.in_flight,
        "max_concurrency": ep.max_concurrency, "rate": ep.rate, "interval_ms": ep.interval_ms,
        "adaptive_limit": s.adaptive_limit,
        "admitted_last_window": admitted,
        **{c: s.counters[c] for c in COUNTERS},
        "admitted_per_s": _rate(s.raw, "admitted", now),
        "throughput_per_s": _rate(s.raw, "done", now),
        "rate_limit_per_s": round(ep.rate * 1000 / ep.interval_ms, 3) if ep.rate else None,
        "exec_ms": s.exec_ms, "slot_ms": s.slot_ms,
        "avg_queue_wait_s": round(qw.sum_ms / qw.count / 1000, 3) if qw.count else None,
        "wait_time_new_s": s.wait_for_new_s(now),
        "oldest_pending_age_s": round(max(0, now - oldest) / 1000, 3) if oldest else None,
        "recent_failures": [
            {"task_id": f["task_id"], "at_s_ago": round((now - int(f["at"])) / 1000, 1),
             "code": f.get("code"), "reason": f.get("reason", "")}
            for f in _failures(s.raw)],
        "enabled": ep.enabled,
        "paused": ep.paused,  # by an operator: dispatch stops, submits are still accepted
        # Paused by its upstream (429/503 with Retry-After, x-ratelimit-*: 0) until then, or
        # past that time and waiting for a probe call to succeed.
        "upstream_paused_until": rfc3339(s.upstream_paused_until),
        **_binding(s, now),
    }


def _binding(s: EndpointStats, now: int) -> dict[str, Any]:
    binding, at = binding_limit(s, now)
    return {"binding_limit": binding, "admits_next_at": rfc3339(at)}


def binding_limit(s: EndpointStats, now: int) -> tuple[str | None, int | None]:
    """What holds the endpoint's line back now, and when (ms) it admits next (None: at once,
    or once a slot frees): the operator's pause, its upstream's, the rate limit, or the cap."""
    ep, raw = s.endpoint, s.raw
    limited_until = int(raw.get("limited_until") or 0)
    if s.pending == 0:  # nothing waits: nothing binds
        return None, None
    if ep.paused:
        return "paused", None
    if s.upstream_paused_until is not None:  # past its time: until a probe call succeeds
        return "upstream", (s.upstream_paused_until if s.upstream_paused_until > now else None)
    if limited_until > now:
        # The claim names the limit that refused longest (limits.lua lim_name): the endpoint's
        # own rate, or one of `limits` as rate/interval/per.
        return _limit_named(raw.get("limited_by") or "main"), limited_until
    if ep.max_concurrency and s.in_flight >= current_cap(ep, raw.get("alimit")):
        return "concurrency", None
    return None, None


def possible_limits(ep: EndpointConfig) -> list[str]:
    """Every `binding_limit` the endpoint can show, named as binding_limit names them: the
    series /metrics keeps at 0 or 1, so none appears only while it binds."""
    names = ["paused", "upstream"]
    if ep.rate:
        names.append("rate")
    names += [_limit_named(f"{x.rate}/{x.interval_ms}/{x.per}") for x in ep.limits]
    if ep.max_concurrency:
        names.append("concurrency")
    return names


def _limit_named(name: str) -> str:
    """`rate` for the endpoint's own limit, else the further limit as operators wrote it
    (`limits: 1/60000ms per request`)."""
    if name.count("/") != 2:
        return "upstream" if name == "upstream" else "rate"
    rate, interval, per = name.split("/")
    return f"limits: {rate}/{interval}ms per {per}"
