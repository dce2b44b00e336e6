"""Signed webhooks (docs/api.md), against `qgw dispatcher` processes and a receiver that checks
every signature with the key's webhook_secret and counts deliveries by X-Queue-Delivery."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import math
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from app.mock_upstream import binary_body
from app.queue import webhooks
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import free_port
from tests.test_metrics import scrape, value

FAST = {"QGW_WEBHOOK_TIMEOUT_S": "1"}  # lease 2 s: a killed sender's delivery comes back soon


def verify(secret: str, header: str, delivery: str, body: bytes) -> bool:
    """The recipe of docs/guides/webhooks.md: v1 signs the time, the delivery id and the body."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t, v1 = parts.get("t", ""), parts.get("v1", "")
    want = hmac.new(secret.encode(), f"{t}.{delivery}.".encode() + body, hashlib.sha256)
    return (t.isdigit() and abs(time.time() - int(t)) < 300
            and hmac.compare_digest(want.hexdigest(), v1))


@dataclass
class Receiver:
    """Answers by path: `/hooks/ok/...` 200; `/hooks/flaky/...` 500 to a delivery's first two
    tries, then 200; `/hooks/hold/...` holds its first request (until released), then 200;
    `/hooks/hang/...` holds every request until the test ends (not recorded)."""

    base: str = ""
    secret: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hung: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        delivery = request.headers.get("X-Queue-Delivery", "")
        seen = sum(1 for r in self.requests if r["delivery"] == delivery)
        if "/hang/" in request.path:  # accepts, never answers (until the test ends)
            self.hung += 1
            await self.release.wait()
            return web.Response(status=503)
        rec = {"path": request.path, "delivery": delivery, "valid": self.verify(request, body),
               "wall": time.time(),
               "signature": request.headers.get("X-Queue-Signature", ""), "raw": body,
               "body": json.loads(body), "at": time.monotonic(), "status": 200}
        self.requests.append(rec)
        if "/flaky/" in request.path and seen < 2:
            rec["status"] = 500
        elif "/hold/" in request.path and seen == 0:
            rec["status"] = 503  # never reaches the sender: it is killed meanwhile
            self.held.set()
            await self.release.wait()
        return web.Response(status=rec["status"])

    def verify(self, request: web.Request, body: bytes) -> bool:
        return verify(self.secret, request.headers.get("X-Queue-Signature", ""),
                      request.headers.get("X-Queue-Delivery", ""), body)

    def accepted(self) -> Counter[str]:
        return Counter(r["delivery"] for r in self.requests if r["status"] == 200)

    def counts(self) -> dict[str, int]:
        acc = self.accepted()
        return {"requests": len(self.requests), "deliveries": len(acc),
                "duplicates": sum(n - 1 for n in acc.values()),
                "signature_failures": sum(not r["valid"] for r in self.requests)}

    async def wait_accepted(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.accepted()) < n:
            assert time.monotonic() < deadline, f"delivered {self.counts()}, expected {n}"
            await asyncio.sleep(0.05)


@asynccontextmanager
async def serving() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/{tail:.*}", rec.handle)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    rec.base = f"http://127.0.0.1:{port}"
    try:
        yield rec
    finally:
        rec.release.set()
        await runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with serving() as rec:
        yield rec


async def hook_key(gw: Gateway, rec: Receiver, urls: list[str] | None = None) -> dict[str, str]:
    """A key whose tasks may call back under the receiver's /hooks/; the receiver checks
    signatures with its webhook_secret."""
    r = await gw.http.post("/admin/v1/api-keys", headers=gw.admin, json={
        "user_id": 5, "max_priority": 3,
        "callback_urls": [f"{rec.base}/hooks/"] if urls is None else urls})
    assert r.status_code == 201, r.text
    rec.secret = r.json()["webhook_secret"]
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def test_finished_tasks_delivered_once_signed(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    await gateway.add_endpoint("wh", f"{upstream}/wh/call")
    await gateway.add_endpoint("whp", f"{upstream}/wh/paused", paused=True)
    auth = await hook_key(gateway, receiver)
    listed = (await gateway.http.get("/admin/v1/api-keys", headers=gateway.admin)).json()
    assert listed[0]["callback_urls"] == [f"{receiver.base}/hooks/"]
    assert receiver.secret not in json.dumps(listed)  # shown once, at creation

    cb = f"{receiver.base}/hooks/ok/"
    done = await gateway.submit(auth, f"{upstream}/wh/call", callback_url=cb + "a?x=1")
    failed = await gateway.submit(auth, f"{upstream}/wh/call", callback_url=cb + "b",
                                  headers={"X-Mock-Status": ["400"]})
    picture = await gateway.submit(auth, f"{upstream}/wh/call", callback_url=cb + "d",
                                   headers={"X-Mock-Binary": ["1000;seed=3"]})
    plain = await gateway.submit(auth, f"{upstream}/wh/call")  # no callback_url: no webhook
    cancelled = await gateway.submit(auth, f"{upstream}/wh/paused", callback_url=cb + "c")
    r = await gateway.http.post(f"/api/v1/tasks/{cancelled['task_id']}/cancel", headers=auth)
    assert r.status_code == 200  # ended while no dispatcher runs: its webhook waits in Redis

    dispatcher_process(**FAST)
    await receiver.wait_accepted(4)
    await gateway.wait_finished(auth, [plain["task_id"]])
    await asyncio.sleep(1.5)  # nothing more arrives
    counts = receiver.counts()
    print("webhook counts (completed, failed, cancelled, binary):", counts)
    assert counts == {"requests": 4, "deliveries": 4, "duplicates": 0, "signature_failures": 0}
    by_task = {r["body"]["task_id"]: r for r in receiver.requests}
    assert set(by_task) == {done["task_id"], failed["task_id"], cancelled["task_id"],
                            picture["task_id"]}
    for task_id, want, path in ((done["task_id"], "completed", "/hooks/ok/a"),
                                (failed["task_id"], "failed", "/hooks/ok/b"),
                                (cancelled["task_id"], "cancelled", "/hooks/ok/c"),
                                (picture["task_id"], "completed", "/hooks/ok/d")):
        rec = by_task[task_id]
        assert rec["path"] == path
        assert rec["body"]["task_status"] == want
        assert rec["delivery"].startswith(task_id + ":")
        assert rec["body"] == await gateway.status(auth, task_id)  # the status JSON itself
    # ... with what the answer was: its type and size (app/queue/answers.py)
    kept = by_task[done["task_id"]]["body"]
    assert kept["result_content_type"] == "application/json"
    assert kept["result_bytes"] == len(kept["task_result"].encode())
    png = by_task[picture["task_id"]]["body"]  # bytes that are not text: base64, exact
    assert (png["result_encoding"], png["result_content_type"]) == ("base64", "image/png")
    assert base64.b64decode(png["task_result"]) == b"".join(binary_body(1000, 3))


async def test_signature_covers_the_delivery_id(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    """A captured delivery replayed under a new X-Queue-Delivery fails the v1 check; the old
    v0 (time and body only) is still sent for one release."""
    await gateway.add_endpoint("whr", f"{upstream}/wh/replay")
    auth = await hook_key(gateway, receiver)
    await gateway.submit(auth, f"{upstream}/wh/replay", callback_url=f"{receiver.base}/hooks/ok/r")
    dispatcher_process(**FAST)
    await receiver.wait_accepted(1)
    got = receiver.requests[0]
    assert got["valid"], got["signature"]
    task_id, _, ended = got["delivery"].rpartition(":")
    replayed = f"{task_id}:{int(ended) + 1}"
    assert not verify(receiver.secret, got["signature"], replayed, got["raw"])
    assert not verify(receiver.secret, got["signature"], got["delivery"], got["raw"] + b" ")
    parts = dict(p.split("=", 1) for p in got["signature"].split(","))
    assert set(parts) == {"t", "v1", "v0"}
    v0 = hmac.new(receiver.secret.encode(), f"{parts['t']}.".encode() + got["raw"],
                  hashlib.sha256).hexdigest()
    assert hmac.compare_digest(v0, parts["v0"])


@pytest.mark.backends("single", "cluster")  # hookclaim, hookretry and hookdone on both
async def test_retried_until_2xx_with_one_delivery_id(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    await gateway.add_endpoint("whf", f"{upstream}/wh/flaky")
    auth = await hook_key(gateway, receiver)
    task = await gateway.submit(auth, f"{upstream}/wh/flaky",
                                callback_url=f"{receiver.base}/hooks/flaky/1")
    dispatcher_process(**FAST)
    for _ in range(300):
        if receiver.requests:
            break
        await asyncio.sleep(0.05)
    # Read by its owner while its webhook is due: the task keeps no TTL until it is delivered.
    assert (await gateway.status(auth, task["task_id"]))["task_status"] == "completed"
    task_key = gateway.rt.keys.task(task["task_id"])
    assert await gateway.rt.redis.pttl(task_key) == -1
    await receiver.wait_accepted(1)
    await asyncio.sleep(1.5)
    counts = receiver.counts()
    print("webhook counts (500, 500, then 200):", counts)
    assert counts == {"requests": 3, "deliveries": 1, "duplicates": 0, "signature_failures": 0}
    assert [r["status"] for r in receiver.requests] == [500, 500, 200]
    assert len({r["delivery"] for r in receiver.requests}) == 1
    at = [r["at"] for r in receiver.requests]
    gaps = [at[1] - at[0], at[2] - at[1]]
    assert gaps[0] >= 0.7 and gaps[1] >= 1.4, gaps  # back-off: ~1 s, then ~2 s
    for _ in range(40):  # delivered: it gets the done TTL now
        if await gateway.rt.redis.pttl(task_key) > 0:
            break
        await asyncio.sleep(0.1)
    assert await gateway.rt.redis.pttl(task_key) > 0
    m = await scrape(gateway)
    assert [value(m, f"qgw_webhooks_{o}_total", "whf") for o in HOOK_OUTCOMES] == [1, 2, 0]


HOOK_OUTCOMES = ("delivered", "retried", "given_up")


async def test_a_sender_whose_clock_is_an_hour_ahead_still_retries(
    gateway: Gateway, upstream: str, receiver: Receiver,
    start_dispatcher: Callable[[], Awaitable[Runtime]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A webhook is given up once its task ended an hour ago by the Redis clock that stamped
    the ending, read through the delivery's claim: a sender host whose own clock is an hour
    ahead took the first failed try of a fresh ending for its last."""
    ahead = SimpleNamespace(time=lambda: time.time() + 3600)  # the sender's host clock
    monkeypatch.setattr(webhooks, "time", ahead)
    await gateway.add_endpoint("whc", f"{upstream}/wh/clock")
    auth = await hook_key(gateway, receiver)
    await gateway.submit(auth, f"{upstream}/wh/clock",
                         callback_url=f"{receiver.base}/hooks/flaky/2")
    await start_dispatcher()
    await receiver.wait_accepted(1)
    assert [r["status"] for r in receiver.requests] == [500, 500, 200]


async def test_a_webhook_of_a_revoked_key_is_given_up_and_counted(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    await gateway.add_endpoint("whr", f"{upstream}/wh/revoked", paused=True)
    auth = await hook_key(gateway, receiver)
    task = await gateway.submit(auth, f"{upstream}/wh/revoked",
                                callback_url=f"{receiver.base}/hooks/ok/r")
    r = await gateway.http.post(f"/api/v1/tasks/{task['task_id']}/cancel", headers=auth)
    assert r.status_code == 200  # its webhook is due in Redis
    (key,) = (await gateway.http.get("/admin/v1/api-keys", headers=gateway.admin)).json()
    r = await gateway.http.delete(f"/admin/v1/api-keys/{key['id']}", headers=gateway.admin)
    assert r.status_code == 204, r.text
    dispatcher_process(**FAST)
    for _ in range(200):
        m = await scrape(gateway)
        if value(m, "qgw_webhooks_given_up_total", "whr") == 1:
            break
        await asyncio.sleep(0.1)
    assert [value(m, f"qgw_webhooks_{o}_total", "whr") for o in HOOK_OUTCOMES] == [0, 0, 1]
    assert receiver.requests == []


async def test_kill_9_mid_delivery_still_delivers(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    await gateway.add_endpoint("whk", f"{upstream}/wh/kill")
    auth = await hook_key(gateway, receiver)
    task = await gateway.submit(auth, f"{upstream}/wh/kill",
                                callback_url=f"{receiver.base}/hooks/hold/1")
    first = dispatcher_process(**FAST)
    await asyncio.wait_for(receiver.held.wait(), 30)  # its POST is in flight
    first.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.wait)
    dispatcher_process(**FAST)
    await receiver.wait_accepted(1)
    await asyncio.sleep(1.5)
    counts = receiver.counts()
    print("webhook counts (kill -9 mid-delivery):", counts)
    assert counts == {"requests": 2, "deliveries": 1, "duplicates": 0, "signature_failures": 0}
    assert {r["delivery"] for r in receiver.requests} == {
        f"{task['task_id']}:{receiver.requests[0]['delivery'].rpartition(':')[2]}"}


async def test_callback_url_only_under_the_keys_callback_urls(
    gateway: Gateway, upstream: str, receiver: Receiver,
) -> None:
    await gateway.add_endpoint("whs", f"{upstream}/wh/ssrf")
    auth = await hook_key(gateway, receiver)
    base, port = receiver.base, receiver.base.rpartition(":")[2]
    refused = [
        f"{base}/admin/x", f"{base}/hooksx", f"{base}/hooks/../admin",
        f"{base}/hooks/%2e%2e/admin", f"http://127.0.0.1:{free_port()}/hooks/x",
        f"https://127.0.0.1:{port}/hooks/x", f"http://127.0.0.1.example:{port}/hooks/x",
        f"http://127.0.0.1:{port}@10.0.0.1/hooks/", f"http://u:p@127.0.0.1:{port}/hooks/",
        "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd", "not a url", "",
    ]
    for url in refused:
        r = await gateway.http.post("/api/v1/tasks", headers=auth, json={
            "target_url": f"{upstream}/wh/ssrf", "callback_url": url})
        assert r.status_code == 422, (url, r.text)
        assert r.json()["error"]["code"] == "callback_not_allowed", url
    rejected = await scrape(gateway)  # this process's counter: other tests' refusals too
    assert rejected[("qgw_submit_rejections_total", (("reason", "callback_not_allowed"),))
                    ] >= len(refused)
    for url in (f"{base}/hooks/x?y=1", f"HTTP://127.0.0.1:{port}/hooks/"):
        await gateway.submit(auth, f"{upstream}/wh/ssrf", callback_url=url)

    # A key with no callback_urls may name none, not even the gateway's own Redis.
    bare = await hook_key(gateway, receiver, urls=[])
    r = await gateway.http.post("/api/v1/tasks", headers=bare, json={
        "target_url": f"{upstream}/wh/ssrf", "callback_url": "http://127.0.0.1:6379/"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "callback_not_allowed"
    for bad in ("http://u:p@app.example/hooks/", "ftp://app.example/", "https://app.example/#x"):
        r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin, json={
            "user_id": 5, "callback_urls": [bad]})
        assert r.status_code == 422, (bad, r.text)


async def test_endpoint_with_webhooks_due_is_not_deleted(
    gateway: Gateway, upstream: str, receiver: Receiver,
) -> None:
    await gateway.add_endpoint("whd", f"{upstream}/wh/delete", paused=True)
    auth = await hook_key(gateway, receiver)
    task = await gateway.submit(auth, f"{upstream}/wh/delete",
                                callback_url=f"{receiver.base}/hooks/ok/d")
    r = await gateway.http.post(f"/api/v1/tasks/{task['task_id']}/cancel", headers=auth)
    assert r.status_code == 200
    r = await gateway.http.delete("/admin/v1/endpoints/whd", headers=gateway.admin)
    assert r.status_code == 409 and "webhooks" in r.json()["error"]["message"], r.text
    r = await gateway.http.get("/admin/v1/endpoints/whd", headers=gateway.admin)
    assert r.status_code == 200  # still there, put back


async def test_callback_path_escapes_refused(
    gateway: Gateway, upstream: str, receiver: Receiver,
) -> None:
    """Paths a receiver's server reads as another one (Tomcat/Spring drop `;` parameters,
    IIS takes a backslash for `/`, some servers decode twice) never pass for `/hooks/`."""
    await gateway.add_endpoint("whe", f"{upstream}/wh/escape")
    auth = await hook_key(gateway, receiver)
    base = receiver.base
    for tail in ("..;/admin", "%2e%2e;/admin", "..%5cadmin", "..%5Cadmin", "x%2f..%2fadmin",
                 "%252e%252e/admin", "a;b/c", "x%2F", "%00/x", ".%2e/admin"):
        r = await gateway.http.post("/api/v1/tasks", headers=auth, json={
            "target_url": f"{upstream}/wh/escape", "callback_url": f"{base}/hooks/{tail}"})
        assert r.status_code == 422, (tail, r.text)
        assert r.json()["error"]["code"] == "callback_not_allowed", tail
    for tail in ("ok/a%20b", "ok/100%25", "ok/..x/y"):  # encoded, but nothing to resolve
        await gateway.submit(auth, f"{upstream}/wh/escape", callback_url=f"{base}/hooks/{tail}")
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin, json={
        "user_id": 5, "callback_urls": [f"{base}/hooks;x=1/"]})
    assert r.status_code == 422, r.text


async def test_a_hung_receiver_does_not_delay_other_receivers(
    gateway: Gateway, upstream: str, receiver: Receiver,
    dispatcher_process: Callable[..., Any],
) -> None:
    """User A's 256 webhooks go to a receiver that accepts and never answers; user B's (another
    receiver) keep arriving within 2 s of their tasks' end (p99 of 30), as A's receiver gets
    a small share of the delivery slots and rests after its timeouts."""
    await gateway.add_endpoint("whi", f"{upstream}/wh/isolated")
    async with serving() as hung:
        a = await hook_key(gateway, hung)
        b = await hook_key(gateway, receiver)
        dispatcher_process(QGW_WEBHOOK_TIMEOUT_S="5")
        for start in range(0, 256, 64):
            await asyncio.gather(*(gateway.submit(a, f"{upstream}/wh/isolated",
                                                  callback_url=f"{hung.base}/hooks/hang/{i}")
                                   for i in range(start, start + 64)))
        ids = []
        for i in range(30):  # over 15 s: A's first calls hang, time out (5 s), rest, probe
            task = await gateway.submit(b, f"{upstream}/wh/isolated",
                                        callback_url=f"{receiver.base}/hooks/ok/{i}")
            ids.append(task["task_id"])
            await asyncio.sleep(0.5)
        await receiver.wait_accepted(30, timeout=60)
        assert hung.hung >= 1  # A's receiver was being called meanwhile
        ended = {v["task_id"]: datetime.fromisoformat(v["ended_at"]).timestamp()
                 for v in await gateway.wait_finished(b, ids)}
        late = sorted(r["wall"] - ended[r["body"]["task_id"]] for r in receiver.requests)
        hung_calls = hung.hung
    p99 = late[math.ceil(0.99 * len(late)) - 1]  # nearest rank: the slowest of 30
    print(f"B's webhooks under A's 256 hung ones: p50 {late[len(late) // 2]:.2f} s, "
          f"p99 {p99:.2f} s; A's receiver was called {hung_calls} times")
    assert p99 <= 2.0, late
    assert hung_calls <= 8 + 15  # its share, then a probe a rest (the old sender: 261)
    assert receiver.counts()["signature_failures"] == 0
