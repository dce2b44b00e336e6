"""The FastAPI app factory."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp

from app import __version__, logs, openapi
from app.connections import RequestCap, max_requests
from app.metrics import HttpRequests
from app.routes import (
    admin,
    admin_ops,
    admin_tasks,
    auth_check,
    dashboard,
    errors,
    follow,
    ops,
    proxy,
    results,
    tasks,
)
from app.routes.fastlane import FastHandler, fast_lane
from app.runtime import Runtime

# FastAPI 0.165+ looks for OpenTelemetry providers (environment reads) on every request, a
# tenth of a submit's CPU; the gateway exports its own /metrics and its own spans
# (app/tracing.py).
_NO_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})

#: The routes answered in front of the app's routing (app/routes/fastlane.py), by router.
FAST_LANES: tuple[tuple[APIRouter, dict[Any, FastHandler]], ...] = (
    (tasks.router, {tasks.submit: tasks.submit, tasks.status: tasks.status_fast}),
    (proxy.router, {proxy.proxy: proxy.proxy_fast}),
)


def create_app(
    runtime: Runtime, manage: bool = True, on_started: Callable[[], None] | None = None
) -> FastAPI:
    """The app; with `manage`, its lifespan starts and stops the runtime."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage:
            await runtime.start()
        if on_started:
            on_started()
        try:
            yield
        finally:
            if manage:
                await runtime.stop()

    # /docs and /redoc with their assets served from the package (fastapi-offline), not a
    # CDN: the pages work without internet access.
    app = FastAPIOffline(title="queue-gateway", version=__version__, lifespan=lifespan,
                         static_url="/docs/assets",
                         generate_unique_id_function=openapi.operation_id, **_NO_TELEMETRY)
    app.state.runtime = runtime
    errors.install(app)
    for router in (tasks.router, results.router, follow.router, auth_check.router, admin.router,
                   admin_tasks.router, admin_ops.router, ops.router,
                   dashboard.router, proxy.router):
        app.include_router(router)
    openapi.install(app)
    lanes = [fast_lane(app, router, handlers) for router, handlers in FAST_LANES]
    cap = max_requests(runtime.settings)

    def front(stack: ASGIApp) -> ASGIApp:
        for lane in lanes:
            stack = lane(stack)
        stack = HttpRequests(stack, counts=runtime.scrapes.http)  # /metrics, fast lanes too
        return stack if cap is None else RequestCap(stack, limit=cap)  # refuses before all

    _in_front(app, front)
    # Patterns catch keys and permits; these two have no recognisable shape.
    logs.redact(runtime.settings.admin_secret, runtime.settings.permit_key.decode())
    return app


def _in_front(app: FastAPI, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
    """`wrap`'s middleware in front of the app's whole stack, not inside FastAPI's own layers
    (its server error, telemetry and body-limit middleware, a fifth of a proxied request's
    way to its handler, which the fast lanes do without: their errors, unexpected ones too,
    go through the app's own handlers, app/routes/fastlane.py)."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: wrap(build())  # type: ignore[method-assign]
