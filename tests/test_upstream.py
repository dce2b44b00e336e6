"""What reaches the business API: the registered endpoint's URL, the caller's query, and only
the headers on the allow-list (the defaults plus the endpoint's `forward_headers`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from sqlalchemy import text

from alembic import command
from app import migrate
from app.core.registry import Mirror
from app.db import make_engine
from app.endpoints import DEFAULT_FORWARD
from app.runtime import Runtime
from app.store import EndpointStore
from tests.conftest import Gateway

IDENTITIES = ("X-HTTP-Method-Override", "X-Remote-User", "X-Auth-Request-User", "X-Webauth-User",
              "X-User-Id", "X-Client-IP", "X-Rewrite-URL", "X-Forwarded-User", "Authorization",
              "Cookie", "X-API-Key")


def _log(upstream: str, path: str) -> list[dict[str, Any]]:
    return [e for e in httpx.get(f"{upstream}/_mock/log").json() if e["path"] == path]


async def test_caller_credentials_and_identities_never_reach_the_upstream(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/up/creds"
    await gateway.add_endpoint("creds", url, forward_headers=["X-Tenant"])
    auth = await gateway.new_key()
    with_password = url.replace("http://", "http://admin:s3cret@")
    for smuggled in (with_password, url.replace("http://", "http://admin@")):
        r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                    json={"target_url": smuggled})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "credentials_not_allowed"
    sent = {name: ["alice"] for name in IDENTITIES}
    sent |= {"Content-Type": ["application/json"], "x-tenant": ["t1"], "X-Trace": ["t2"],
             "Accept-Language": ["fr"]}
    task = await gateway.submit(auth, f"{url}?size=1", headers=sent, body="{}")
    await start_dispatcher()
    (done,) = await gateway.wait_finished(auth, [task["task_id"]])
    assert done["task_status"] == "completed"
    (call,) = _log(upstream, "/up/creds")
    got = call["headers"]
    assert got["content-type"] == "application/json" and got["accept-language"] == "fr"
    assert got["x-tenant"] == "t1"  # the endpoint's own addition
    assert "x-trace" not in got  # a custom header nobody listed
    leaked = [name for name in IDENTITIES if name.lower() in got]
    assert leaked == [] and call["query"] == {"size": "1"}


async def test_a_changed_target_url_applies_to_queued_tasks(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """Calls go to the endpoint as registered when they are made, with the caller's query."""
    old, new = f"{upstream}/up/old", f"{upstream}/up/new"
    await gateway.add_endpoint("moving", old)
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, f"{old}?n={i}", body=str(i),
                                 query_params={"size": ["512"]}))["task_id"]
           for i in range(5)]
    r = await gateway.http.patch("/admin/v1/endpoints/moving", headers=gateway.admin,
                                 json={"target_url": new})
    assert r.status_code == 200, r.text
    await start_dispatcher()
    done = await gateway.wait_finished(auth, ids)
    assert {d["task_status"] for d in done} == {"completed"}
    assert _log(upstream, "/up/old") == []
    calls = _log(upstream, "/up/new")
    assert sorted((c["body"], c["query"]["n"], c["query"]["size"]) for c in calls) == [
        (str(i), str(i), "512") for i in range(5)]


async def test_forward_headers_are_validated_and_kept(gateway: Gateway) -> None:
    base = {"id": "fwd", "target_url": "http://127.0.0.1:9/up/fwd"}
    post = gateway.http.post
    for bad in (["Host"], ["Bad Name"], ["Transfer-Encoding"], ["X-Queue-Permit"], "X-A"):
        r = await post("/admin/v1/endpoints", headers=gateway.admin,
                       json={**base, "forward_headers": bad})
        assert r.status_code == 422, (bad, r.text)
    r = await post("/admin/v1/endpoints", headers=gateway.admin, json=base)
    assert r.status_code == 201 and r.json()["forward_headers"] == []
    r = await gateway.http.patch("/admin/v1/endpoints/fwd", headers=gateway.admin,
                                 json={"forward_headers": ["X-Tenant", "Authorization"]})
    assert r.status_code == 200, r.text
    got = await gateway.http.get("/admin/v1/endpoints/fwd", headers=gateway.admin)
    assert got.json()["forward_headers"] == ["X-Tenant", "Authorization"]
    assert gateway.rt.registry.get("fwd").forwarded >= {"x-tenant", "authorization"}  # type: ignore[union-attr]


async def test_endpoints_registered_before_forward_headers_get_the_defaults(db_url: str) -> None:
    """Migration 0004 on SQLite and MariaDB: rows already there read back with []."""
    await asyncio.to_thread(command.upgrade, migrate._config(db_url), "0003")
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO endpoints (id, name, target_url, methods, limiter, rate, "
                "interval_ms, max_concurrency, avg_exec_ms, timeout_ms, max_retries, "
                "retry_backoff_ms, max_queue_len, permit_ttl_s, permit_max_uses, enabled, "
                "created_at, updated_at) VALUES ('old', '', 'http://svc:9000/api/x', "
                "'[\"POST\"]', 'sliding_window', 0, 1000, 0, 1000, 30000, 3, 1000, 100, 20, 3, "
                "1, '2026-11-01 00:00:00', '2026-11-01 00:00:00')"))
        await asyncio.to_thread(migrate.upgrade, db_url)
        store = EndpointStore(engine, Mirror.__new__(Mirror))  # list() reads SQL only
        (old,) = await store.list()
    finally:
        await engine.dispose()
    assert old.forward_headers == [] and old.forwarded == DEFAULT_FORWARD
