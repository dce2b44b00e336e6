"""The FastAPI app factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__, errors, logs
from app.routes import admin, auth_check, dashboard, follow, ops, tasks
from app.runtime import Runtime


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

    # Operation ids are the handlers' names (`submit`, `status`, `follow_task`, ...): what a
    # client generated from the OpenAPI document calls its methods.
    app = FastAPI(title="queue-gateway", version=__version__, lifespan=lifespan,
                  generate_unique_id_function=lambda route: route.name)
    app.state.runtime = runtime
    errors.install(app)
    for router in (tasks.router, follow.router, auth_check.router, admin.router, ops.router,
                   dashboard.router):
        app.include_router(router)
    # Patterns catch keys and permits; these two have no recognisable shape.
    logs.redact(runtime.settings.admin_secret, runtime.settings.permit_key.decode())
    return app
