"""Exact queue counts for the admin view: one pipeline for all endpoints, no key scans."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from app.endpoints import EndpointConfig
from app.queue.keys import Keys


async def queue_stats(redis: Redis, keys: Keys, endpoints: list[EndpointConfig]) -> list[Any]:
    now_s, now_us = await redis.time()
    now = now_s * 1000 + now_us // 1000
    async with redis.pipeline(transaction=False) as pipe:
        for ep in endpoints:
            pipe.zcard(keys.queue(ep.id))
            pipe.zcard(keys.active(ep.id))
            pipe.zrange(keys.queue(ep.id), 0, 0)
            pipe.hgetall(keys.stats(ep.id))
            if ep.limiter == "sliding_window":
                pipe.zcount(keys.ratelimit(ep.id, ep.limiter), f"({now - ep.interval_ms}", "+inf")
            else:
                pipe.exists(keys.ratelimit(ep.id, ep.limiter))  # placeholder keeps the stride
        raw = await pipe.execute()
    heads = [r[0] for r in raw[2::5] if r]
    async with redis.pipeline(transaction=False) as pipe:
        for head in heads:
            pipe.hget(keys.task(head), "created_at")
        created_at = dict(zip(heads, await pipe.execute(), strict=True))
    out = []
    for i, ep in enumerate(endpoints):
        pending, inflight, head, stats, admitted = raw[i * 5:i * 5 + 5]
        oldest = created_at.get(head[0]) if head else None
        out.append({
            "id": ep.id, "pending": pending, "in_flight": inflight,
            "admitted_last_window": admitted if ep.limiter == "sliding_window" else None,
            "completed": int(stats.get("completed", 0)), "failed": int(stats.get("failed", 0)),
            "retried": int(stats.get("retried", 0)),
            "exec_ms": float(stats["exec_ms"]) if "exec_ms" in stats else None,
            "oldest_pending_age_s": round((now - int(oldest)) / 1000, 3) if oldest else None,
        })
    return out
