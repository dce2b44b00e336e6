"""The gateway check of online permits, in nginx and Traefik header styles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import yaml

from app import ROOT, permits
from app.runtime import Runtime
from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")  # the online path on both

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
    # Another first character of the MAC: other bytes, always (a new last "AA" was the same
    # token 1 time in 1,024, and its last character carries two bits no decoder reads).
    expiry, mac = s["permit"]["token"].split(".")
    forged = {**_nginx(s), "X-Queue-Permit": f"{expiry}.{'C' if mac[0] == 'B' else 'B'}{mac[1:]}"}
    assert (await check("/auth/check", headers=forged)).status_code == 403
    later = s["permit"]["token"].split(".")[0]
    stretched = {
        **_nginx(s),
        "X-Queue-Permit": f"{int(later) + 60000}." + s["permit"]["token"].split(".")[1],
    }
    assert (await check("/auth/check", headers=stretched)).status_code == 403
    # An expiry int() cannot read (`²` passes str.isdigit): refused, not a 500.
    odd = {**_nginx(s), "X-Queue-Permit": "\u00b2." + s["permit"]["token"].split(".")[1]}
    assert (await check("/auth/check", headers={
        k: v.encode("latin-1") if k == "X-Queue-Permit" else v for k, v in odd.items()
    })).status_code == 403
    # Nor one of more digits than int() reads (4300): refused, not a 500.
    long = {**_nginx(s), "X-Queue-Permit": "9" * 4400 + "." + s["permit"]["token"].split(".")[1]}
    assert (await check("/auth/check", headers=long)).status_code == 403
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


def _traefik(
    client: dict[str, str], method: str, uri: str, forward_auth: dict[str, Any]
) -> dict[str, str]:
    """The headers Traefik's forwardAuth sends the gateway for a client's request (its
    writeHeader): the client's headers, only those in authRequestHeaders when that is set,
    then X-Forwarded-* of its own over any the client sent (trustForwardHeader off)."""
    allowed = {h.lower() for h in forward_auth.get("authRequestHeaders") or []}
    sent = {k: v for k, v in client.items() if not allowed or k.lower() in allowed}
    sent = {k: v for k, v in sent.items() if not k.lower().startswith("x-forwarded-")}
    return {**sent, "X-Forwarded-For": "203.0.113.7", "X-Forwarded-Method": method,
            "X-Forwarded-Proto": "http", "X-Forwarded-Host": "gateway.example",
            "X-Forwarded-Uri": uri}


async def test_under_traefik_only_the_request_line_traefik_sets_decides(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """A client's own X-Original-* (or X-Forwarded-*) never picks the path that is checked."""
    _, s = await _admitted(gateway, start_dispatcher, permit_max_uses=1)
    shipped = yaml.safe_load((ROOT / "deploy" / "traefik" / "traefik.yml").read_text())
    shipped = shipped["http"]["middlewares"]["queue-permit"]["forwardAuth"]
    assert not shipped.get("trustForwardHeader")  # else the client's X-Forwarded-* would count
    permit = {"X-Queue-Task-Id": s["task_id"], "X-Queue-Permit": s["permit"]["token"]}
    smuggled = {**permit, "X-Original-URI": "/api/live", "X-Original-Method": "POST",
                "X-Forwarded-Uri": "/api/live", "X-Forwarded-Method": "POST"}
    check = gateway.http.get
    forward_auth: dict[str, Any]
    for forward_auth in (shipped, {}):  # as shipped, and a Traefik forwarding every header
        for method, uri in (("DELETE", "/api/admin/delete_all"), ("POST", "/api/other"),
                            ("DELETE", "/api/live"), ("POST", "//api/api/live"),
                            ("POST", "//api%2flive/api/live")):
            sent = _traefik(smuggled, method, uri, forward_auth)
            assert (await check("/auth/check", headers=sent)).status_code == 403, (uri, sent)
    assert (await check("/auth/check", headers=permit)).status_code == 403  # no request line
    sent = _traefik(smuggled, "POST", "/api/live?x=1", shipped)
    assert (await check("/auth/check", headers=sent)).status_code == 200


async def test_permit_expiry_follows_the_redis_clock_not_the_hosts(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An API host whose clock runs ahead must not refuse a fresh permit, nor one running
    behind pass a permit that has expired by the clock every replica shares (Redis's)."""
    _, s = await _admitted(gateway, start_dispatcher, permit_ttl_s=20, permit_max_uses=10)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 60)
    r = await gateway.http.get("/auth/check", headers=_nginx(s))
    assert r.status_code == 200, r.text

    # The task's admission ended a second ago by the Redis clock; its permit says so too.
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    redis, tid = gateway.rt.redis, s["task_id"]
    seconds, micros = await redis.time()
    ended = seconds * 1000 + micros // 1000 - 1000
    await redis.hset(gateway.rt.keys.task(tid), "deadline", ended)
    stale = permits.sign(gateway.rt.settings.permit_key, tid, ended)
    r = await gateway.http.get("/auth/check", headers={**_nginx(s), "X-Queue-Permit": stale})
    assert r.status_code == 403 and "expired" in r.json()["error"]["message"], r.text


async def test_a_retried_online_task_gets_a_permit_of_its_own(
    gateway: Gateway, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """A permit used up and left to lapse ends its task `expired`; an operator's retry admits
    it again with a new permit, whose uses count from none (lua/requeue-7.lua), not from the
    old permit's."""
    auth, s = await _admitted(gateway, start_dispatcher, permit_max_uses=1, permit_ttl_s=3)
    assert (await gateway.http.get("/auth/check", headers=_nginx(s))).status_code == 200
    assert (await gateway.http.get("/auth/check", headers=_nginx(s))).status_code == 403
    (ended,) = await gateway.wait_finished(auth, [s["task_id"]])
    assert ended["task_status"] == "expired"
    r = await gateway.http.post(f"/admin/v1/tasks/{s['task_id']}/retry", headers=gateway.admin)
    assert r.status_code == 200, r.text
    for _ in range(100):
        again = await gateway.status(auth, s["task_id"])
        if again["permit"]:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the retried task was not admitted again")
    assert again["permit"]["token"] != s["permit"]["token"]
    assert (await gateway.http.get("/auth/check", headers=_nginx(again))).status_code == 200
