"""The hot routes, answered in front of Starlette's routing and FastAPI's per-request work.

A submit spent more CPU in the layers between the server and its handler (the router trying
each route's pattern, the exception-handling wrappers, an exit stack per request, FastAPI's
dependency solving for a route that has none, each layer wrapping `send` again) than in the
handler itself. A route named here is matched by method and path from a middleware placed
in front of the app's own stack, just inside the /metrics request counter: its fast handler
takes only the request (it reads its body, parameters and caller itself) and may decline a
request (None), which then takes the usual way; its errors go through the app's own
exception handlers. The FastAPI route
behind it still describes it in the OpenAPI document and serves every other spelling of the
path (a trailing slash, a HEAD).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

FastHandler = Callable[[Request], Awaitable[Response | None]]
log = logging.getLogger(__name__)


def fast_lane(app: FastAPI, router: APIRouter, handlers: dict[Any, FastHandler]
              ) -> Callable[[ASGIApp], ASGIApp]:
    """The middleware answering these routes of `router` (by their endpoint function) with
    the fast handler given for each, to put in front of what answers the rest (app/main.py
    puts it in front of the app's whole stack). A route's path is fixed, ends in its one
    parameter (`/tasks/{task_id}`), or is a prefix, one segment and the rest
    (`/proxy/{endpoint_id}/{path:path}`). That no other route of the app is shadowed by one
    is `shadowed`'s to say, in a test: not checked at every start."""
    exact, tails, rests = _tables(router, handlers)
    return lambda inner: _FastLane(inner, app, exact, tails, rests)


def _tables(router: APIRouter, handlers: dict[Any, FastHandler]
            ) -> tuple[dict[tuple[str, str], tuple[APIRoute, FastHandler]],
                       dict[tuple[str, str], tuple[APIRoute, FastHandler, str]],
                       dict[tuple[str, str], tuple[APIRoute, FastHandler, str, str]]]:
    exact: dict[tuple[str, str], tuple[APIRoute, FastHandler]] = {}
    tails: dict[tuple[str, str], tuple[APIRoute, FastHandler, str]] = {}
    rests: dict[tuple[str, str], tuple[APIRoute, FastHandler, str, str]] = {}
    for route in router.routes:
        if not isinstance(route, APIRoute) or route.endpoint not in handlers:
            continue
        handler = handlers[route.endpoint]
        head, _, param = route.path.rpartition("/")
        for method in route.methods or ():
            if "{" not in route.path:
                exact[(method, route.path)] = (route, handler)
            elif "{" not in head and param.startswith("{") and param.endswith("}"):
                tails[(method, head + "/")] = (route, handler, param[1:-1])
            elif (m := _REST.fullmatch(route.path)) is not None:
                rests[(method, m[1])] = (route, handler, m[2], m[3])
            else:
                raise ValueError(f"{route.path}: not a path the fast lane matches")
    return exact, tails, rests


#: `/prefix/` `{segment}` `/{rest:path}`: a prefix that no other route of the app starts with.
_REST = re.compile(r"(/[^{}]+/)\{(\w+)\}/\{(\w+):path\}")


def shadowed(app: FastAPI, router: APIRouter, handlers: dict[Any, FastHandler]) -> list[str]:
    """The app's fixed routes that a fast route of `router` taking a parameter would answer
    instead (`GET /tasks/stats` beside `GET /tasks/{task_id}`: the router would have tried
    them in order, the fast lane never does). Every route the app answers, its included
    routers' too (FastAPI nests them: `iter_route_contexts` walks them, as its OpenAPI
    document does). A test's to ask (tests/test_validation.py): walking them makes FastAPI
    build every route's context, most of the app's creation (0.08 s of CPU), which the
    routes a process never serves would otherwise never need."""
    tails = _tables(router, handlers)[1]
    found = []
    for route in iter_route_contexts(app.routes):
        path, methods = route.path or "", route.methods or ()
        head, _, last = path.rpartition("/")
        if "{" in path or not last:
            continue
        for method in methods:
            if (hit := tails.get((method.upper(), head + "/"))) is not None:
                found.append(f"{method.upper()} {path} would be answered by the fast lane's "
                             f"{hit[0].path}")
    return found


class _FastLane:
    def __init__(self, app: ASGIApp, owner: FastAPI,
                 exact: dict[tuple[str, str], tuple[APIRoute, FastHandler]],
                 tails: dict[tuple[str, str], tuple[APIRoute, FastHandler, str]],
                 rests: dict[tuple[str, str], tuple[APIRoute, FastHandler, str, str]]
                 ) -> None:
        self.app, self.owner, self.exact, self.tails = app, owner, exact, tails
        self.rests = rests
        self.prefixes = {prefix for _, prefix in rests}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._match(scope) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            on_error = self._exception_handler(exc)
            if on_error is None:
                # A bug: logged, and answered by the app's handler for Exception (the one its
                # server error middleware runs); without one, raised for the server's 500.
                on_error = self._server_error()
                if on_error is None:
                    raise
                log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            response = await on_error(request, exc)
        if response is None:  # declined: the router answers, as for any other request
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    def _match(self, scope: Scope) -> FastHandler | None:
        """The fast handler for this request, its route and parameters set in `scope`."""
        method, path = scope["method"], _route_path(scope)
        if (hit := self.exact.get((method, path))) is not None:
            scope["route"] = hit[0]  # what FastAPI names it by (/metrics counts by route)
            return hit[1]
        head, _, value = path.rpartition("/")
        if value and (tail := self.tails.get((method, head + "/"))) is not None:
            route, handler, name = tail
            scope["route"], scope["path_params"] = route, {name: value}
            return handler
        return self._match_rest(scope, method, path) if self.prefixes else None

    def _match_rest(self, scope: Scope, method: str, path: str) -> FastHandler | None:
        for prefix in self.prefixes:
            if path.startswith(prefix):
                segment, slash, rest = path[len(prefix):].partition("/")
                hit = self.rests.get((method, prefix))
                if not segment or not slash or hit is None:
                    return None  # the router's to answer (a 404, a 405)
                route, handler, name, rest_name = hit
                scope["route"], scope["path_params"] = route, {name: segment, rest_name: rest}
                return handler
        return None

    def _server_error(self) -> Callable[..., Awaitable[Response]] | None:
        """The app's handler for Exception (what its server error middleware runs)."""
        handlers: dict[Any, Any] = self.owner.exception_handlers
        return handlers.get(Exception)

    def _exception_handler(self, exc: Exception) -> Callable[..., Awaitable[Response]] | None:
        handlers: dict[Any, Any] = self.owner.exception_handlers
        for cls in type(exc).__mro__:
            if cls is Exception:  # a catch-all is the server error middleware's to run
                break
            if cls in handlers:
                return handlers[cls]  # type: ignore[no-any-return]
        return None


def _route_path(scope: Scope) -> str:
    """The path the router matches: past the root path when it is one (as Starlette's)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path
