"""The gateway check of online permits, in nginx and Traefik header styles."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from app.runtime import Runtime
from tests.conftest import Gateway

URL = "http://127.0.0.1:9/api/live"


async def _admitted(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]], **fields: Any
) -> tuple[dict[str, str], dict[str, Any]]:
    await gateway.add_endpoint("live", URL, methods=["POST"], max_concurrency=2, **fields)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, URL, task_type="online")
    await start_dispatcher()
    for _ in range(100):
        s = await gateway.status(auth, task["task_id"])
        if s["permit"]:
            return auth, s
        await asyncio.sleep(0.05)
    raise AssertionError("the online task was not admitted")


def _nginx(s: dict[str, Any], uri: str = "/api/live?x=1", method: str = "POST") -> dict[str, str]:
    return {
        "X-Queue-Task-Id": s["task_id"],
        "X-Queue-Permit": s["permit"]["token"],
        "X-Original-URI": uri,
        "X-Original-Method": method,
    }


async def test_permit_lets_calls_through_up_to_its_use_limit(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    _, s = await _admitted(gateway, start_dispatcher, permit_max_uses=2)
    check = gateway.http.get
    assert (await check("/auth/check", headers=_nginx(s))).status_code == 200
    traefik = {
        "X-Queue-Task-Id": s["task_id"],
        "X-Queue-Permit": s["permit"]["token"],
        "X-Forwarded-Uri": "/api/live",
        "X-Forwarded-Method": "POST",
        "X-Forwarded-Host": "gateway.example",
    }
    assert (await check("/auth/check", headers=traefik)).status_code == 200
    assert (await check("/auth/check", headers=_nginx(s))).status_code == 403  # used up


async def test_missing_forged_or_misdirected_permits_are_refused(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    _, s = await _admitted(gateway, start_dispatcher)
    check = gateway.http.get
    assert (await check("/auth/check")).status_code == 401
    assert (
        await check("/auth/check", headers={"X-Queue-Task-Id": s["task_id"]})
    ).status_code == 401
    forged = {**_nginx(s), "X-Queue-Permit": s["permit"]["token"][:-2] + "AA"}
    assert (await check("/auth/check", headers=forged)).status_code == 403
    later = s["permit"]["token"].split(".")[0]
    stretched = {
        **_nginx(s),
        "X-Queue-Permit": f"{int(later) + 60000}." + s["permit"]["token"].split(".")[1],
    }
    assert (await check("/auth/check", headers=stretched)).status_code == 403
    assert (await check("/auth/check", headers=_nginx(s, uri="/api/other"))).status_code == 403
    assert (await check("/auth/check", headers=_nginx(s, method="DELETE"))).status_code == 403
    assert (await check("/auth/check", headers=_nginx(s))).status_code == 200


async def test_cancel_and_complete_revoke_the_permit(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    auth, s = await _admitted(gateway, start_dispatcher)
    assert (await gateway.http.get("/auth/check", headers=_nginx(s))).status_code == 200
    r = await gateway.http.post(f"/api/v1/tasks/{s['task_id']}/cancel", headers=auth)
    assert r.json()["task_status"] == "cancelled"
    assert (await gateway.http.get("/auth/check", headers=_nginx(s))).status_code == 403

    task = await gateway.submit(auth, URL, task_type="online")
    for _ in range(100):
        s2 = await gateway.status(auth, task["task_id"])
        if s2["permit"]:
            break
        await asyncio.sleep(0.05)
    await gateway.http.post(f"/api/v1/tasks/{task['task_id']}/complete", headers=auth)
    assert (await gateway.http.get("/auth/check", headers=_nginx(s2))).status_code == 403
