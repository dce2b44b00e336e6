"""Bad input gets a clear JSON error of docs/api.md's shape, and disturbs nothing already queued."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request

from app.main import FAST_LANES, create_app
from app.routes.fastlane import shadowed
from tests.conftest import Gateway

TARGET = "http://127.0.0.1:9/v/gen"


def _is_error(r: object, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    err = r.json()["error"]  # type: ignore[attr-defined]
    assert isinstance(err["message"], str) and err["message"]
    if code:
        assert err["code"] == code


@pytest.fixture
async def ready(gateway: Gateway) -> tuple[Gateway, dict[str, str], str]:
    await gateway.add_endpoint("v", TARGET, methods=["POST", "GET"])
    auth = await gateway.new_key(max_priority=2)
    queued = await gateway.submit(auth, TARGET)
    return gateway, auth, queued["task_id"]


BAD_BODIES = [
    (b"{not json", 400, "invalid_json"),
    (b"", 400, "invalid_json"),
    (b"[1, 2]", 422, "invalid_request"),
    (b'{"http_method": "POST"}', 422, "invalid_request"),  # no target_url
    (b'{"target_url": 12}', 422, "invalid_request"),
    (b'{"target_url": "' + TARGET.encode() + b'", "priority": -1}', 422, "invalid_request"),
    (b'{"target_url": "' + TARGET.encode() + b'", "priority": "1"}', 422, "invalid_request"),
    (b'{"target_url": "' + TARGET.encode() + b'", "task_type": "batch"}', 422, None),
    (b'{"target_url": "' + TARGET.encode() + b'", "http_method": "BREW"}', 422, None),
    (b'{"target_url": "ftp://127.0.0.1:9/v/gen"}', 422, "invalid_request"),
    (b'{"target_url": "file:///etc/passwd"}', 422, "invalid_request"),
    (b'{"target_url": "' + TARGET.encode() + b'", "headers": {"A": "b"}}', 422, None),
    (b'{"target_url": "' + TARGET.encode() + b'", "body": {"x": 1}}', 422, None),
]


@pytest.mark.parametrize(("raw", "status", "code"), BAD_BODIES)
async def test_bad_submit_bodies(
    ready: tuple[Gateway, dict[str, str], str], raw: bytes, status: int, code: str | None
) -> None:
    gw, auth, queued = ready
    r = await gw.http.post(
        "/api/v1/tasks", content=raw, headers={**auth, "Content-Type": "application/json"}
    )
    _is_error(r, status, code)
    assert (await gw.status(auth, queued))["wait_num"] == 0  # still first in line


async def test_oversized_body_is_413(ready: tuple[Gateway, dict[str, str], str]) -> None:
    gw, auth, _ = ready
    big = "x" * (gw.rt.settings.max_body_bytes + 1)
    r = await gw.http.post("/api/v1/tasks", headers=auth, json={"target_url": TARGET, "body": big})
    _is_error(r, 413, "body_too_large")


async def test_unregistered_target_is_404(ready: tuple[Gateway, dict[str, str], str]) -> None:
    gw, auth, _ = ready
    for url in (
        "http://127.0.0.1:9/v/other",
        "http://127.0.0.1:10/v/gen",
        "https://127.0.0.1:9/v/gen",
    ):
        r = await gw.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
        _is_error(r, 404, "endpoint_not_registered")


async def test_query_string_in_target_url_is_allowed(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, _ = ready
    task = await gw.submit(auth, TARGET + "?size=512")
    assert task["wait_num"] == 1


async def test_method_the_endpoint_does_not_take(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, _ = ready
    r = await gw.http.post(
        "/api/v1/tasks", headers=auth, json={"target_url": TARGET, "http_method": "DELETE"}
    )
    _is_error(r, 422, "method_not_allowed")


async def test_priority_above_the_key_is_403_not_clamped(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, _ = ready
    r = await gw.http.post(
        "/api/v1/tasks", headers=auth, json={"target_url": TARGET, "priority": 3}
    )
    _is_error(r, 403, "priority_not_allowed")


async def test_missing_or_wrong_key_is_401(ready: tuple[Gateway, dict[str, str], str]) -> None:
    gw, _, queued = ready
    for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"}):
        _is_error(
            await gw.http.post("/api/v1/tasks", headers=headers, json={"target_url": TARGET}),
            401,
            "unauthorized",
        )
        _is_error(await gw.http.get(f"/api/v1/tasks/{queued}", headers=headers), 401)


async def test_unknown_and_malformed_task_ids_are_404(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, _ = ready
    for tid in ("nope", "0" * 32 + ".v", "0" * 32 + ".Bad..id", "%2e%2e"):
        _is_error(await gw.http.get(f"/api/v1/tasks/{tid}", headers=auth), 404, "task_not_found")
        _is_error(await gw.http.post(f"/api/v1/tasks/{tid}/cancel", headers=auth), 404)


async def test_unknown_route_and_bad_wait_are_json(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, queued = ready
    _is_error(await gw.http.get("/api/v1/nothing", headers=auth), 404)
    _is_error(await gw.http.get(f"/api/v1/tasks/{queued}?wait=99", headers=auth), 422)
    _is_error(await gw.http.get(f"/api/v1/tasks/{queued}?wait=x", headers=auth), 422)
    # Forms the fast lane (app/routes/fastlane.py) leaves to the route: validated as ever.
    for wait in ("-1", "nan", "inf", "", "1e400", "\u0663"):
        _is_error(await gw.http.get(f"/api/v1/tasks/{queued}?wait={wait}", headers=auth), 422)
    for query in ("wait=0.01&other=1", "other=1", "wait=0"):
        r = await gw.http.get(f"/api/v1/tasks/{queued}?{query}", headers=auth)
        assert r.status_code == 200 and r.json()["task_id"] == queued, (query, r.text)


async def test_daily_quota_answers_429_with_retry_after(gateway: Gateway) -> None:
    await gateway.add_endpoint("q", "http://127.0.0.1:9/q")
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 5, "daily_quota": 2})
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    for _ in range(2):
        await gateway.submit(auth, "http://127.0.0.1:9/q")
    r = await gateway.http.post("/api/v1/tasks", headers=auth,
                                json={"target_url": "http://127.0.0.1:9/q"})
    _is_error(r, 429, "quota_exceeded")
    assert 0 < int(r.headers["Retry-After"]) <= 86400
    bad = await gateway.http.post("/api/v1/tasks", headers=auth, json={"target_url": 1})
    _is_error(bad, 422)  # bad input is not counted, and not confused with the quota


async def test_a_whole_float_is_an_integer_as_json_schema_says(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    gw, auth, _ = ready
    ok = await gw.http.post("/api/v1/tasks", headers=auth,
                            json={"target_url": TARGET, "priority": 2.0})
    assert ok.status_code == 202
    _is_error(await gw.http.post("/api/v1/tasks", headers=auth,
                                 json={"target_url": TARGET, "priority": 2.5}), 422)


async def test_daily_quota_counts_the_day_of_the_redis_clock(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API host a day behind once let every submit through a quota of 5: the day (and the
    counter's expiry) came from its own clock."""
    await gateway.add_endpoint("qd", "http://127.0.0.1:9/qd")
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": 6, "daily_quota": 5})
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400)
    codes = [(await gateway.http.post("/api/v1/tasks", headers=auth,
                                      json={"target_url": "http://127.0.0.1:9/qd"})).status_code
             for _ in range(8)]
    assert codes == [202] * 5 + [429] * 3


def test_a_fixed_route_the_fast_lane_would_shadow_is_found() -> None:
    """`GET /t/stats` beside a fast `GET /t/{task_id}` would never reach its own handler."""
    app, fast, other = FastAPI(), APIRouter(), APIRouter()

    @fast.get("/t/{task_id}")
    async def show(task_id: str) -> str:
        return task_id

    @other.get("/t/stats")
    async def stats() -> str:
        return "stats"

    async def show_fast(request: Request) -> None:
        return None

    app.include_router(fast)
    app.include_router(other)
    assert shadowed(app, fast, {show: show_fast}) == [
        "GET /t/stats would be answered by the fast lane's /t/{task_id}"]
    unrelated = FastAPI()
    unrelated.include_router(fast)
    assert shadowed(unrelated, fast, {show: show_fast}) == []  # alone: no complaint


def test_no_route_of_the_gateway_is_shadowed_by_its_fast_lanes(gateway: Gateway) -> None:
    """The check above, on the app as built (not made at each start: app/routes/fastlane.py)."""
    app = create_app(gateway.rt, manage=False)
    for router, handlers in FAST_LANES:
        assert shadowed(app, router, handlers) == []



async def test_validation_errors_name_the_field_and_say_what_is_expected(
    ready: tuple[Gateway, dict[str, str], str],
) -> None:
    """A field called `body` is named like any other, and a pattern is described in words."""
    gw, auth, _ = ready
    headers = {**auth, "Content-Type": "application/json"}
    cases = [
        (b'{"target_url": "' + TARGET.encode() + b'", "body": {"x": 1}}', "body: "),
        (b'{"target_url": "ftp://127.0.0.1:9/v/gen"}',
         "target_url: expected an absolute http:// or https:// URL"),
        (b"[1, 2]", "the body: "),
    ]
    for raw, start in cases:
        r = await gw.http.post("/api/v1/tasks", content=raw, headers=headers)
        _is_error(r, 422, "invalid_request")
        message = r.json()["error"]["message"]
        assert message.startswith(start) and "pattern" not in message, message
    # Admin routes validated by FastAPI: its `body` location part goes, the field stays.
    r = await gw.http.post("/admin/v1/endpoints", headers=gw.admin,
                           json={"id": "Bad Id", "target_url": "http://127.0.0.1:9/x"})
    _is_error(r, 422)
    assert r.json()["error"]["message"].startswith("id: expected 1 to 64 lowercase"), r.text
    r = await gw.http.post("/admin/v1/endpoints", headers=gw.admin,
                           json={"id": "ok", "target_url": "http://127.0.0.1:9/x?q=1"})
    _is_error(r, 422)
    assert r.json()["error"]["message"].startswith("target_url: "), r.text
    r = await gw.http.post("/admin/v1/endpoints", headers=gw.admin, content=b"[]")
    _is_error(r, 422)
    assert "pattern" not in r.json()["error"]["message"], r.text


async def test_endpoint_changes_that_disagree_together_are_422_not_500(
    ready: tuple[Gateway, dict[str, str], str]
) -> None:
    """Each field valid alone, the whole endpoint not (adaptive with no maximum): found by
    schemathesis as a 500 on PUT and PATCH."""
    gateway, _, _ = ready
    admin, path = gateway.admin, "/admin/v1/endpoints/v"
    r = await gateway.http.patch(path, headers=admin,
                                 json={"concurrency": "adaptive", "max_concurrency": 0})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
    assert "max_concurrency" in r.json()["error"]["message"]
    whole = (await gateway.http.get(path, headers=admin)).json()
    whole.pop("id", None)
    r = await gateway.http.put(path, headers=admin,
                               json={**whole, "concurrency": "adaptive", "max_concurrency": 0})
    assert r.status_code == 422, r.text
    assert (await gateway.http.get(path, headers=admin)).json()["concurrency"] == "fixed"


async def test_a_task_search_takes_times_only_as_iso_8601(
    ready: tuple[Gateway, dict[str, str], str]
) -> None:
    gateway, _, _ = ready
    for value in ("0.5", "1700000000", "-3"):
        r = await gateway.http.get("/admin/v1/tasks", headers=gateway.admin,
                                   params={"until": value})
        assert r.status_code == 422, (value, r.text)
    r = await gateway.http.get("/admin/v1/tasks", headers=gateway.admin,
                               params={"since": "2026-11-25T10:00:00Z"})
    assert r.status_code == 200, r.text
    # A cursor no finished task can have (before year 1), found by schemathesis as a 500.
    r = await gateway.http.get("/admin/v1/tasks", headers=gateway.admin, params={
        "status": "failed", "cursor": "-88469909327378:x", "since": "0082-08-24T15:42:55+17:39"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_cursor", r.text


async def test_an_unexpected_error_is_answered_in_the_error_shape(
    ready: tuple[Gateway, dict[str, str], str], start_api: Any
) -> None:
    """An error no handler names (here Redis refusing writes: out of memory) is a 500 in the
    API's error shape, with nothing of the exception in it, on a keep-alive connection that
    stays usable; what is queued stays, and all is well again once Redis is."""
    gateway, auth, queued = ready
    base = await start_api()
    redis = gateway.rt.redis
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=10) as http:
        await redis.config_set("maxmemory", 1)  # every write refused: OOM
        try:
            refused = await http.post("/api/v1/tasks", json={"target_url": TARGET})
        finally:
            await redis.config_set("maxmemory", 0)
        _is_error(refused, 500, "internal_error")
        assert "OOM" not in refused.text and "memory" not in refused.text
        status = await http.get(f"/api/v1/tasks/{queued}")
        assert status.status_code == 200 and status.json()["task_status"] == "pending"
        assert (await http.post("/api/v1/tasks", json={"target_url": TARGET})).status_code == 202
