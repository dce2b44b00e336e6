"""The admin API: endpoint table and API keys, and how fast other processes see changes."""

from __future__ import annotations

import asyncio
import time

from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway


async def test_endpoint_crud(gateway: Gateway) -> None:
    h, http = gateway.admin, gateway.http
    body = {"id": "gen-image", "target_url": "http://svc:9000/api/generate_image", "rate": 300}
    assert (await http.post("/admin/v1/endpoints", headers=h, json=body)).status_code == 201
    dup = await http.post("/admin/v1/endpoints", headers=h, json=body)
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "endpoint_exists"
    same_url = await http.post("/admin/v1/endpoints", headers=h, json={**body, "id": "other"})
    assert same_url.status_code == 409
    got = (await http.get("/admin/v1/endpoints/gen-image", headers=h)).json()
    assert got["rate"] == 300 and got["limiter"] == "sliding_window" and got["enabled"] is True
    patched = await http.patch("/admin/v1/endpoints/gen-image", headers=h, json={"rate": 5})
    assert patched.json()["rate"] == 5 and patched.json()["target_url"] == body["target_url"]
    bad = await http.patch("/admin/v1/endpoints/gen-image", headers=h, json={"rate": -1})
    assert bad.status_code == 422 and "error" in bad.json()
    put = await http.put(
        "/admin/v1/endpoints/gen-image",
        headers=h,
        json={"target_url": "http://svc:9000/v2", "methods": ["get"]},
    )
    assert put.json()["methods"] == ["GET"] and put.json()["rate"] == 0
    assert [e["id"] for e in (await http.get("/admin/v1/endpoints", headers=h)).json()] == [
        "gen-image"
    ]
    assert (await http.delete("/admin/v1/endpoints/gen-image", headers=h)).status_code == 204
    assert (await http.get("/admin/v1/endpoints/gen-image", headers=h)).status_code == 404


async def test_admin_needs_the_token(gateway: Gateway) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = await gateway.http.get("/admin/v1/endpoints", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


async def test_bad_endpoint_configs(gateway: Gateway) -> None:
    for body in (
        {"id": "Bad Id", "target_url": "http://a/b"},
        {"id": "x", "target_url": "ftp://a/b"},
        {"id": "x", "target_url": "http://a:0/b"},  # nowhere to call
        {"id": "x", "target_url": "http://a/b?q=1"},
        {"id": "x", "target_url": "http://a/b", "limiter": "leaky"},
        {"id": "x", "target_url": "http://a/b", "unknown": 1},
    ):
        r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin, json=body)
        assert r.status_code == 422, body


async def test_keys_are_shown_once_and_revocable(gateway: Gateway) -> None:
    await gateway.add_endpoint("k", "http://127.0.0.1:9/k")
    r = await gateway.http.post(
        "/admin/v1/api-keys",
        headers=gateway.admin,
        json={"user_id": 7, "tier": "vip", "max_priority": 2, "daily_quota": 10000},
    )
    created = r.json()
    auth = {"Authorization": f"Bearer {created['key']}"}
    await gateway.submit(auth, "http://127.0.0.1:9/k")
    listed = (await gateway.http.get("/admin/v1/api-keys", headers=gateway.admin)).json()
    assert listed[0]["id"] == created["id"] and listed[0]["key"] is None
    assert created["key"] not in str(listed)
    await gateway.http.delete(f"/admin/v1/api-keys/{created['id']}", headers=gateway.admin)
    r = await gateway.http.post(
        "/api/v1/tasks", headers=auth, json={"target_url": "http://127.0.0.1:9/k"}
    )
    assert r.status_code == 401


async def test_another_process_sees_a_new_endpoint_within_a_second(
    gateway: Gateway, settings: Settings
) -> None:
    other = Runtime(settings)
    await other.start()
    try:
        await gateway.add_endpoint("late", "http://127.0.0.1:9/late")
        t0 = time.monotonic()
        while other.registry.get("late") is None:
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(0.02)
        await gateway.http.patch(
            "/admin/v1/endpoints/late", headers=gateway.admin, json={"rate": 9}
        )
        t0 = time.monotonic()
        while other.registry.get("late").rate != 9:  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(0.02)
    finally:
        await other.stop()


async def test_mirror_is_rebuilt_from_sql_when_redis_lost_it(gateway: Gateway) -> None:
    await gateway.add_endpoint("kept", "http://127.0.0.1:9/kept")
    keys = gateway.rt.keys
    await gateway.rt.redis.delete(keys.endpoints, keys.version("endpoints"))
    await gateway.rt.registry.mirror.refresh()
    assert await gateway.rt.redis.hexists(keys.endpoints, "kept")
