"""The original go-zero service's clients keep working: every submit, status and cancel answer
decodes into their response structs, whose numbers are `int64`.

Go's `encoding/json` refuses any number written with a fraction or an exponent (`1.75`, even
`2.0`) for an integer field and fails the whole answer; `_go_decode` does the same.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from app.runtime import Runtime
from tests.conftest import Gateway


class _GoStruct(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # Go ignores unknown fields


class SubmitResp(_GoStruct):
    task_id: StrictStr
    task_status: StrictStr
    created_at: StrictStr | None
    wait_num: StrictInt
    wait_time: StrictInt


class StatusResp(_GoStruct):
    task_id: StrictStr
    task_type: StrictStr
    task_status: StrictStr
    task_result: StrictStr | None
    wait_num: StrictInt
    wait_time: StrictInt
    created_at: StrictStr | None
    started_at: StrictStr | None
    ended_at: StrictStr | None
    result_status_code: StrictInt | None
    attempts: StrictInt


class CancelResp(_GoStruct):
    task_id: StrictStr
    task_status: StrictStr


def _no_fractions(literal: str) -> float:
    raise ValueError(f"json: cannot unmarshal number {literal} into Go value of type int64")


def _go_decode(model: type[_GoStruct], r: httpx.Response) -> dict[str, Any]:
    assert r.status_code in (200, 202), r.text
    body: dict[str, Any] = json.loads(r.text, parse_float=_no_fractions)
    model.model_validate(body)
    return body


async def test_every_answer_decodes_with_int64_numbers(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    http = gateway.http
    # 3 a second and 2 slots of 1.5 s: the estimates are fractions of a second before rounding.
    url = f"{upstream}/go-clients"
    await gateway.add_endpoint("go", url, rate=3, interval_ms=1000, max_concurrency=2,
                               avg_exec_ms=1500)
    auth = await gateway.new_key()
    submitted = []
    for i in range(6):
        r = await http.post("/api/v1/tasks", headers={**auth, "Idempotency-Key": f"go-{i}"},
                            json={"target_url": url, "body": str(i),
                                  "headers": {"X-Mock-Latency-Ms": ["300"]}})
        submitted.append(_go_decode(SubmitResp, r))
    # Whole seconds, rounded up: one ahead at 3/s is 0.33 s, five ahead 2.63 s (two slots).
    assert [t["wait_time"] for t in submitted] == [0, 1, 1, 2, 2, 3]
    again = await http.post("/api/v1/tasks", headers={**auth, "Idempotency-Key": "go-5"},
                            json={"target_url": url, "body": "5"})
    assert _go_decode(SubmitResp, again)["task_id"] == submitted[5]["task_id"]

    ids = [t["task_id"] for t in submitted]
    pending = _go_decode(StatusResp, await http.get(f"/api/v1/tasks/{ids[5]}", headers=auth))
    assert pending["task_status"] == "pending" and pending["wait_time"] == 3
    cancelled = await http.post(f"/api/v1/tasks/{ids[5]}/cancel", headers=auth)
    assert _go_decode(CancelResp, cancelled)["task_status"] == "cancelled"

    await start_dispatcher()
    seen = set()
    for _ in range(200):
        views = [_go_decode(StatusResp, await http.get(f"/api/v1/tasks/{t}", headers=auth))
                 for t in ids]
        seen |= {v["task_status"] for v in views}
        if all(v["task_status"] not in ("pending", "processing") for v in views):
            break
        await asyncio.sleep(0.05)
    assert {"pending", "processing", "completed", "cancelled"} <= seen
    assert [v["task_status"] for v in views] == ["completed"] * 5 + ["cancelled"]


def _go_null_is_zero(body: dict[str, Any]) -> dict[str, Any]:
    """Go's decoder leaves an int64 field at 0 for a JSON null, without an error."""
    return {k: 0 if v is None and k in ("wait_num", "wait_time") else v for k, v in body.items()}


async def test_a_paused_endpoints_unknown_wait_decodes_as_zero(gateway: Gateway,
                                                              upstream: str) -> None:
    """While an operator has paused the endpoint, wait_time is null (unknown): the structs
    still decode (to 0), and nothing else in the answers changes type."""
    url = f"{upstream}/go-paused"
    await gateway.add_endpoint("go-paused", url, paused=True)
    auth = await gateway.new_key()
    r = await gateway.http.post("/api/v1/tasks", headers=auth, json={"target_url": url})
    assert r.json()["wait_time"] is None
    SubmitResp.model_validate(_go_null_is_zero(json.loads(r.text, parse_float=_no_fractions)))
    r = await gateway.http.get(f"/api/v1/tasks/{r.json()['task_id']}", headers=auth)
    assert r.json()["wait_time"] is None
    StatusResp.model_validate(_go_null_is_zero(json.loads(r.text, parse_float=_no_fractions)))
