"""The hot routes, answered in front of Starlette's routing and FastAPI's per-request work.

A submit spent more CPU in the layers between the server and its handler (the router trying
each route's pattern, two exception-handling wrappers, an exit stack per request, FastAPI's
dependency solving for a route that has none, each layer wrapping `send` again) than in the
handler itself. A route named here is called by exact method and path from a middleware
placed just inside the /metrics request counter: its handler takes only the request (it reads
its body and resolves its caller itself), its errors go through the app's own exception
handlers, and the FastAPI route behind it still describes it in the OpenAPI document and
serves every other spelling of the path (a trailing slash, a HEAD).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


def fast_lane(app: FastAPI, router: APIRouter, *handlers: Handler) -> None:
    """Answer these handlers of `router` in the fast lane; call before adding the middleware
    that should see them (the request counter)."""
    routes = {(method, route.path): (route, route.endpoint)
              for route in router.routes if isinstance(route, APIRoute)
              and route.endpoint in handlers for method in route.methods or ()}
    app.add_middleware(_FastLane, owner=app, routes=routes)


class _FastLane:
    def __init__(self, app: ASGIApp, owner: FastAPI,
                 routes: dict[tuple[str, str], tuple[APIRoute, Handler]]) -> None:
        self.app, self.owner, self.routes = app, owner, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
                hit := self.routes.get((scope["method"], _route_path(scope)))) is None:
            await self.app(scope, receive, send)
            return
        route, handler = hit
        scope["route"] = route  # what FastAPI names it by (/metrics counts by route)
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            on_error = self._exception_handler(exc)
            if on_error is None:
                raise  # a bug: the server error middleware outside answers 500
            response = await on_error(request, exc)
        await response(scope, receive, send)

    def _exception_handler(self, exc: Exception) -> Callable[..., Awaitable[Response]] | None:
        handlers: dict[Any, Any] = self.owner.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return handlers[cls]  # type: ignore[no-any-return]
        return None


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
