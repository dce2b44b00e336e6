"""`GET /dashboard`: one page, no build step, that shows every queue live.

The page and its scripts hold no data, so they are served to anyone; the numbers come from the
admin-protected `GET /admin/v1/queues` (and /overview, /history), which the script polls with
`Authorization: Bearer`, and the actions (pause, purge, retry, cancel) are admin routes too.
The script takes the admin token from a prompt or from the URL fragment (`#token=...`, which
browsers never send to a server, so it stays out of access logs), keeps it in sessionStorage
(gone with the tab) and removes it from the address bar.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from app.errors import ApiError

router = APIRouter(tags=["ops"])
STATIC = Path(__file__).resolve().parent.parent / "static"
_HEADERS = {
    # Only our own script and styles; the page cannot be framed (clickjacking) and sends no
    # referrer.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def _file(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/dashboard", response_class=Response,
            responses={200: {"content": {"text/html": {}}}})
async def dashboard() -> Response:
    """The queue dashboard (asks for the admin token; its data needs it)."""
    return Response(_file("dashboard.html"), media_type="text/html; charset=utf-8",
                    headers=_HEADERS)


#: What the page loads beside itself: name in its URL -> file in app/static, media type.
_ASSETS = {
    "chart.js": ("chart.js", "text/javascript"),
    "app.js": ("dashboard.js", "text/javascript"),
    "actions.js": ("actions.js", "text/javascript"),
    "search.js": ("search.js", "text/javascript"),
    "style.css": ("dashboard.css", "text/css"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}


@router.get("/dashboard/{asset}", response_class=Response, include_in_schema=False)
async def dashboard_asset(asset: str) -> Response:
    if asset not in _ASSETS:
        raise ApiError(404, "not_found", f"no dashboard file {asset!r}")
    name, media = _ASSETS[asset]
    return Response(_file(name), media_type=f"{media}; charset=utf-8", headers=_HEADERS)


@router.get("/favicon.ico", response_class=Response, include_in_schema=False)
async def favicon() -> Response:
    """The icon browsers ask for on any page (/docs too): the dashboard's, an SVG (browsers
    go by the media type, not the name)."""
    return Response(_file("favicon.svg"), media_type="image/svg+xml",
                    headers={"Cache-Control": "max-age=86400"})
