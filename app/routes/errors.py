"""Every error leaves as `{"error": {"code": ..., "message": ...}}` with a fitting status: the
app's exception handlers (`install`)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import AskError, ClusterError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError as SQLInterfaceError
from sqlalchemy.exc import OperationalError as SQLOperationalError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Match

from app.errors import ApiError, describe

log = logging.getLogger(__name__)


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, **extra}}, status, headers=headers
    )


def _allowed(app: FastAPI, request: Request) -> set[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return methods


_HTTP_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", describe(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; list them all.
            headers = {"Allow": ", ".join(sorted(_allowed(app, request)))}
        return error_response(exc.status_code, code, str(exc.detail), headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # Nobody is left to answer, and nothing went wrong here: one line, no traceback.
        log.debug("client went away before sending its whole request: %s %s",
                  request.method, request.url.path)
        return Response(status_code=400)  # dropped: the server sends nothing to a gone client

    @app.exception_handler(SQLOperationalError)
    @app.exception_handler(SQLInterfaceError)
    async def _sql_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", str(exc).splitlines()[0][:300])
        return error_response(
            503, "database_unavailable", "the database is unavailable; retry shortly",
            {"Retry-After": "5"},
        )

    @app.exception_handler(TimeoutError)
    async def _store_slow(_: Request, exc: Exception) -> JSONResponse:
        # Our own bounds on SQL statements (app/db.py); Redis has its own TimeoutError.
        log.warning("a store did not answer in time")
        return error_response(
            503, "database_unavailable", "the database did not answer in time; retry shortly",
            {"Retry-After": "5"},
        )

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    # A replica (e.g. a master demoted by a failover, still named by a plain redis:// URL)
    # takes no writes: to a client that is the queue store being unavailable, not a bug.
    @app.exception_handler(RedisReadOnlyError)
    # A Cluster between a master's death and its replica's promotion (CLUSTERDOWN), or a slot
    # moving between masters longer than redis-py follows it (TRYAGAIN/ASK until "TTL
    # exhausted"): nothing was run.
    @app.exception_handler(ClusterError)
    # The same after redis-py gave up following a redirection (a pipeline's reply, say).
    @app.exception_handler(TryAgainError)
    @app.exception_handler(AskError)  # and MovedError
    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return error_response(
            503, "redis_unavailable", "the queue store is unavailable; retry shortly",
            {"Retry-After": "1"},
        )

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # Run by the server error middleware (and the fast lanes): the answer in our shape,
        # with nothing of the exception in it; the exception goes on to the server's log.
        return error_response(500, "internal_error", "the gateway met an unexpected error; "
                              "its log has the details")
