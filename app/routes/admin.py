"""Admin routes: the endpoint table, API keys, queue counts (admin token)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from app.auth import admin, runtime
from app.endpoints import EndpointConfig, EndpointPatch, EndpointSettings
from app.models import ApiKeyCreate, ErrorResponse
from app.queue.stats import queue_stats
from app.routes.body import body_schema, parse, read_limited
from app.runtime import Runtime
from app.secrets import AS_IS

ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorResponse} for c in (400, 401, 404, 409, 413, 422)
}
router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(admin)],
                   responses=ERRORS)
Rt = Annotated[Runtime, Depends(runtime)]
ADMIN_BODY_LIMIT = 64 * 1024


class ApiKeyView(BaseModel):
    id: str
    user_id: int
    tier: str
    max_priority: int
    daily_quota: int
    callback_urls: list[str] = []
    key: str | None = None
    webhook_secret: str | None = None
    created_at: str | None = None
    revoked: bool = False


@router.post("/endpoints", status_code=201, response_model=EndpointConfig,
             openapi_extra=body_schema(EndpointConfig))
async def create_endpoint(request: Request, rt: Rt) -> EndpointConfig:
    config = parse(EndpointConfig, await read_limited(request, ADMIN_BODY_LIMIT))
    return await rt.endpoints.create(config)


@router.get("/endpoints", response_model=list[EndpointConfig])
async def list_endpoints(rt: Rt) -> list[EndpointConfig]:
    return await rt.endpoints.list()


@router.get("/endpoints/{endpoint_id}", response_model=EndpointConfig)
async def get_endpoint(endpoint_id: str, rt: Rt) -> EndpointConfig:
    return await rt.endpoints.get(endpoint_id)


@router.put("/endpoints/{endpoint_id}", response_model=EndpointConfig,
            openapi_extra=body_schema(EndpointSettings))
async def replace_endpoint(endpoint_id: str, request: Request, rt: Rt) -> EndpointConfig:
    config = parse(EndpointSettings, await read_limited(request, ADMIN_BODY_LIMIT))
    # As given (AS_IS): the store seals upstream_headers; any other dump would mask them.
    return await rt.endpoints.update(endpoint_id, config.model_dump(context=AS_IS))


@router.patch("/endpoints/{endpoint_id}", response_model=EndpointConfig,
              openapi_extra=body_schema(EndpointPatch))
async def patch_endpoint(endpoint_id: str, request: Request, rt: Rt) -> EndpointConfig:
    changes = parse(EndpointPatch, await read_limited(request, ADMIN_BODY_LIMIT))
    # null means "leave as is": no endpoint field can be null.
    return await rt.endpoints.update(
        endpoint_id, changes.model_dump(exclude_unset=True, exclude_none=True, context=AS_IS))


@router.delete("/endpoints/{endpoint_id}", status_code=204)
async def delete_endpoint(endpoint_id: str, rt: Rt) -> Response:
    """Only an idle endpoint goes (409 otherwise); an enabled one is disabled first."""
    await rt.retire_endpoint(endpoint_id)
    return Response(status_code=204)


@router.post("/api-keys", status_code=201, response_model=ApiKeyView,
             openapi_extra=body_schema(ApiKeyCreate))
async def create_api_key(request: Request, rt: Rt) -> ApiKeyView:
    """A new key; `key` is shown in this answer only."""
    body = parse(ApiKeyCreate, await read_limited(request, ADMIN_BODY_LIMIT))
    plain, view = await rt.key_store.create(**body.model_dump())
    return ApiKeyView(**view, key=plain)


@router.get("/api-keys", response_model=list[ApiKeyView])
async def list_api_keys(rt: Rt) -> list[ApiKeyView]:
    return [ApiKeyView(**k) for k in await rt.key_store.list()]


@router.delete("/api-keys/{key_id}", status_code=204)
async def revoke_api_key(key_id: str, rt: Rt) -> Response:
    await rt.key_store.revoke(key_id)
    return Response(status_code=204)


@router.get("/queues", operation_id="list_queues")
async def queues(rt: Rt) -> dict[str, Any]:
    """Per endpoint: exact pending and in flight, counters, admitted and finished a second
    (last minute) against the rate limit, exec and slot time, the estimated wait of a new task,
    oldest pending age and the last failures (one Redis round trip)."""
    return {"endpoints": await queue_stats(rt.redis, rt.keys, rt.queue.scripts,
                                           rt.registry.all())}
