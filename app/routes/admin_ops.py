"""Admin routes for the dashboard beyond the queues: the dispatchers alive, the outbox backlog
and the database's state (`/admin/v1/overview`), and the history the server keeps
(`/admin/v1/history`), so a page opened now shows the last hour (admin token)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from sqlalchemy import text

from app.auth import admin, runtime
from app.db import bounded
from app.errors import ApiError, expects
from app.lifecycle import history
from app.queue import heartbeats
from app.routes.admin import ERRORS
from app.runtime import Runtime

router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(admin)],
                   responses=ERRORS)
Rt = Annotated[Runtime, Depends(runtime)]
DB_PROBE_S = 0.5  # the page polls this: a dead database must not hold it
MAX_HISTORY_ENDPOINTS = 200


async def _database(rt: Runtime) -> str:
    async def select_one() -> None:
        async with rt.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    try:
        await bounded(select_one(), DB_PROBE_S)
        return "ok"
    except Exception as exc:  # whatever it is, the page says so instead of failing
        return f"error: {type(exc).__name__}"


@router.get("/overview", operation_id="overview")
async def overview(rt: Rt) -> dict[str, Any]:
    """Dispatchers heard from in the last seconds with their calls in flight (from their
    heartbeats), finished tasks waiting for SQL (the outbox) per endpoint, and whether the
    database answers."""
    ids = [e.id for e in rt.registry.all()]
    async with rt.redis.pipeline(transaction=False) as pipe:
        for e in ids:
            pipe.zcard(rt.keys.outbox(e))
        backlog = dict(zip(ids, await pipe.execute(), strict=True))
    return {"dispatchers": await heartbeats.alive(rt.redis, rt.keys),
            "outbox_backlog": sum(backlog.values()),
            "outbox_by_endpoint": {e: n for e, n in backlog.items() if n},
            "database": await _database(rt)}


@router.get("/history", operation_id="history")
async def get_history(
    rt: Rt, endpoints: Annotated[str, Query(
        max_length=8_000, pattern=expects(r"^[a-z0-9_,-]*$", "endpoint ids, comma-separated"),
        description="endpoint ids, comma-separated")] = "",
) -> dict[str, Any]:
    """What the server sampled every 10 s over the last hour, per endpoint, oldest first:
    `[t (ms), depth, in flight, finished (a counter), failed (a counter)]`."""
    ids = [e for e in endpoints.split(",") if e] or [e.id for e in rt.registry.all()]
    if len(ids) > MAX_HISTORY_ENDPOINTS:
        raise ApiError(422, "too_many_endpoints",
                       f"ask for at most {MAX_HISTORY_ENDPOINTS} endpoints at once")
    return {"interval_ms": history.INTERVAL_MS, "fields": list(history.FIELDS),
            "endpoints": await history.read(rt.redis, rt.keys, ids)}
