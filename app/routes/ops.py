"""Operations: liveness and readiness."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.auth import runtime
from app.runtime import Runtime

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(rt: Annotated[Runtime, Depends(runtime)]) -> JSONResponse:
    """Redis and the database both answer."""
    checks: dict[str, str] = {}
    try:
        await rt.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # any failure means not ready; say which
        checks["redis"] = f"error: {type(exc).__name__}"
    try:
        async with rt.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        200 if ready else 503)
