"""Operations: liveness, readiness and Prometheus metrics (docs/api.md, Operations)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from sqlalchemy import text

from app.auth import runtime
from app.db import bounded
from app.queue.stats import read_metrics
from app.runtime import Runtime

router = APIRouter(tags=["ops"])
READY_PROBE_TTL_MS = 10_000
# The database's answer is only reported: a probe (often given a second) must not wait on it.
READY_DB_TIMEOUT_S = 0.5


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


async def _select_one(rt: Runtime) -> None:
    async with rt.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))


@router.get("/readyz")
async def readyz(rt: Annotated[Runtime, Depends(runtime)]) -> JSONResponse:
    """Ready while Redis takes writes. The database and the result store are reported, not
    required: submit and the dispatchers carry on without them (finished tasks wait in the
    outbox; a large answer's task is retried), so an outage must not take every API process
    out of rotation at once."""
    checks: dict[str, str] = {}
    try:
        # A write, not a PING: a server demoted to replica answers PING and refuses submits.
        await rt.redis.set(rt.keys.ready_probe(rt.ident), "1", px=READY_PROBE_TTL_MS)
        checks["redis"] = "ok"
    except Exception as exc:  # any failure means not ready; say which
        checks["redis"] = f"error: {type(exc).__name__}"
    try:
        await bounded(_select_one(rt), READY_DB_TIMEOUT_S)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    rt.scrapes.database.record(checks["database"] == "ok")  # qgw_database_up reuses it
    try:  # reported like the database: a store outage fails large answers, not the process
        await asyncio.wait_for(rt.objects.check(), READY_DB_TIMEOUT_S)
        checks["result_store"] = "ok"
    except Exception as exc:
        checks["result_store"] = f"error: {type(exc).__name__}"
    ready = checks["redis"] == "ok"
    healthy = checks["database"] == checks["result_store"] == "ok"
    status = "unavailable" if not ready else "ok" if healthy else "degraded"
    return JSONResponse({"status": status, "checks": checks}, 200 if ready else 503)


# The classic text format (0.0.4): what the output is, and what every Prometheus reads.
@router.get("/metrics", response_class=Response, operation_id="metrics",
            responses={200: {"content": {CONTENT_TYPE_PLAIN_0_0_4: {}}}})
async def prometheus(rt: Annotated[Runtime, Depends(runtime)]) -> Response:
    """Prometheus exposition: per endpoint depth, in flight, counters and histograms (one
    Redis round trip for all endpoints), dispatchers alive, and this process's submit
    latency, HTTP requests and view of the database."""
    text = await rt.scrapes.text(
        lambda: read_metrics(rt.redis, rt.keys, rt.queue.scripts, rt.registry.all()),
        lambda: bounded(_select_one(rt), READY_DB_TIMEOUT_S))
    return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)
