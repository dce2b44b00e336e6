"""What the OpenAPI document adds to FastAPI's: the security schemes (docs/api.md, Authentication)
and operation ids a generated client can use as method names."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    "apiKey": {"type": "http", "scheme": "bearer",
               "description": "An API key: `Authorization: Bearer <api-key>`"},
    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-API-Key",
                     "description": "An API key: `X-API-Key: <api-key>`"},
    "adminToken": {"type": "http", "scheme": "bearer",
                   "description": "The admin token (QGW_ADMIN_TOKEN)"},
}
# By path prefix: the routes resolve their caller themselves (the hot ones without a
# FastAPI dependency), so there is no dependency to read this from.
SECURITY: tuple[tuple[str, list[dict[str, list[str]]]], ...] = (
    ("/api/", [{"apiKey": []}, {"apiKeyHeader": []}]),
    # The drop-in proxy takes the same key (consumed there, never forwarded upstream).
    ("/proxy/", [{"apiKey": []}, {"apiKeyHeader": []}]),
    ("/admin/", [{"adminToken": []}]),
)


def operation_id(route: APIRoute) -> str:
    """The handler's name (`create_endpoint`), not FastAPI's `<name>_<path>_<method>`;
    handlers with a terse name set `operation_id` (`submit_task`)."""
    return route.name


def install(app: FastAPI) -> None:
    """Serve the document with the security schemes declared on every guarded operation."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _secure(build())  # FastAPI keeps the document in app.openapi_schema
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _hoist_defs(doc: dict[str, Any]) -> None:
    """Request bodies of routes that read their body themselves carry pydantic's own schema
    (app/routes/body.py), whose nested models sit in a local `$defs` that `#/$defs/...` refs
    cannot reach from inside the document: move them to components and point the refs there."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for name, sub in node.pop("$defs", {}).items():
                schemas.setdefault(name, sub)
                walk(sub)
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                node["$ref"] = "#/components/schemas/" + ref.removeprefix("#/$defs/")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc["paths"])


def _secure(doc: dict[str, Any]) -> None:
    _hoist_defs(doc)
    doc.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    for path, operations in doc["paths"].items():
        for prefix, security in SECURITY:
            if path.startswith(prefix):
                for op in operations.values():
                    op["security"] = security
