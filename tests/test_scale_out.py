"""What a Redis Cluster changes, checked on one Redis and on a Cluster: a submit's two slots
(the caller's quota and Idempotency-Key, the endpoint's queue) stay exact under races, and
endpoints spread over every master, each served at once by an idle dispatcher."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from app.core.keys import Keys
from app.core.scripts import LUA_DIR, source
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """No reaper pass within a test: a task that starts was woken by its marker, not by the
    reaper's nudge of endpoints whose marker went missing."""
    return settings.model_copy(update={"reap_interval_ms": 60_000})


async def _key(gateway: Gateway, user_id: int, **fields: Any) -> dict[str, str]:
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": user_id, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def test_50_racing_submits_against_a_quota_of_10_admit_exactly_10(
    gateway: Gateway,
) -> None:
    """Spread over two endpoints (two slots on a Cluster), with and without Idempotency-Keys."""
    for e in ("qa", "qb"):
        await gateway.add_endpoint(e, f"http://127.0.0.1:9/{e}")
    auth = await _key(gateway, 41, daily_quota=10)

    async def one(i: int) -> httpx.Response:
        headers = {**auth, "Idempotency-Key": f"race-{i}"} if i % 2 else auth
        return await gateway.http.post("/api/v1/tasks", headers=headers, json={
            "target_url": f"http://127.0.0.1:9/{'qa' if i % 3 else 'qb'}"})

    answers = await asyncio.gather(*(one(i) for i in range(50)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [202] * 10 + [429] * 40, codes
    assert all(r.json()["error"]["code"] == "quota_exceeded" for r in answers
               if r.status_code == 429)


async def test_a_task_refused_by_a_full_queue_gives_back_its_quota_and_its_key(
    gateway: Gateway,
) -> None:
    await gateway.add_endpoint("small", "http://127.0.0.1:9/small", max_queue_len=2)
    auth = await _key(gateway, 42, daily_quota=3)
    url = {"target_url": "http://127.0.0.1:9/small"}
    first = [await gateway.submit(auth, url["target_url"]) for _ in range(2)]
    again = {**auth, "Idempotency-Key": "order-7"}
    full = await gateway.http.post("/api/v1/tasks", headers=again, json=url)
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    r = await gateway.http.post(f"/api/v1/tasks/{first[0]['task_id']}/cancel", headers=auth)
    assert r.status_code == 200, r.text
    # The key names no task that never was: the retry queues one (and counts the 3rd of 3).
    retried = await gateway.http.post("/api/v1/tasks", headers=again, json=url)
    assert retried.status_code == 202, retried.text
    assert retried.json()["task_id"] not in {t["task_id"] for t in first}
    same = await gateway.http.post("/api/v1/tasks", headers=again, json=url)
    assert same.json()["task_id"] == retried.json()["task_id"]
    over = await gateway.http.post("/api/v1/tasks", headers=auth, json=url)
    assert over.status_code == 429, over.text


async def test_endpoints_on_every_master_are_served_by_one_idle_dispatcher(
    gateway: Gateway, upstream: str, backend: str,
    start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    ids = [f"spread{i}" for i in range(12)]
    for e in ids:
        await gateway.add_endpoint(e, f"{upstream}/{e}")
    keys: Keys = gateway.rt.keys
    if backend == "cluster":
        cluster: Any = gateway.rt.redis
        masters = {cluster.get_node_from_key(keys.queue(e)).name for e in ids}
        assert len(masters) == 3, masters  # 12 endpoints in 16 groups over 3 masters
    await start_dispatcher()
    auth = await gateway.new_key()
    await asyncio.sleep(1.5)  # every wake loop is blocked: nothing pending anywhere
    tasks = [(await gateway.submit(auth, f"{upstream}/{e}"))["task_id"] for e in ids]
    done = await gateway.wait_finished(auth, tasks, timeout=20)
    assert [d["task_status"] for d in done] == ["completed"] * len(ids)


async def test_a_key_whose_first_submit_never_queued_makes_the_task_on_retry(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queueing step fails once (its master gone mid-request); the 503 says to retry with
    the same Idempotency-Key, and that retry queues the task (on a Cluster the key was already
    taken in the caller's slot: it must not name a task that never was)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from app.queue.tasks import TaskQueue

    await gateway.add_endpoint("once", "http://127.0.0.1:9/once")
    auth = {**await _key(gateway, 43, daily_quota=5), "Idempotency-Key": "order-9"}
    real, failed = TaskQueue._enqueue, []

    async def fail_once(self: TaskQueue, *args: Any) -> Any:
        if not failed:
            failed.append(1)
            raise RedisConnectionError("the queue's master went away")
        return await real(self, *args)

    monkeypatch.setattr(TaskQueue, "_enqueue", fail_once)
    url = {"target_url": "http://127.0.0.1:9/once"}
    first = await gateway.http.post("/api/v1/tasks", headers=auth, json=url)
    assert first.status_code == 503 and failed, first.text
    retried = await gateway.http.post("/api/v1/tasks", headers=auth, json=url)
    assert retried.status_code == 202, retried.text
    tid = retried.json()["task_id"]
    assert (await gateway.status(auth, tid))["task_status"] == "pending"
    again = await gateway.http.post("/api/v1/tasks", headers=auth, json=url)
    assert again.json()["task_id"] == tid  # the key names it now


async def test_two_submits_with_one_key_to_a_full_queue_both_hear_it_is_full(
    gateway: Gateway,
) -> None:
    await gateway.add_endpoint("tiny", "http://127.0.0.1:9/tiny", max_queue_len=1)
    auth = await _key(gateway, 44)
    await gateway.submit(auth, "http://127.0.0.1:9/tiny")
    same = {**auth, "Idempotency-Key": "twice"}
    answers = await asyncio.gather(*(gateway.http.post(
        "/api/v1/tasks", headers=same, json={"target_url": "http://127.0.0.1:9/tiny"})
        for _ in range(2)))
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == \
        [(503, "queue_full")] * 2


def test_every_script_takes_its_keys_in_keys_as_its_name_and_header_say() -> None:
    """A Cluster runs a script only if its caller names every key it touches (DESIGN.md,
    "Scaling out"): no script builds a key from another (the events channel is a channel), a
    script's name counts its fixed KEYS and its header lists exactly those (and any variable
    tail, `KEYS[n..]`), and a task key built from a prefix in ARGV is said in the header."""
    channel = (LUA_DIR / "includes" / "events.lua").read_text()
    channel = channel[channel.index("local function event_channel"):]
    channel = channel[:channel.index("end\n") + 4]
    problems = []
    for path in sorted(LUA_DIR.glob("*.lua")):
        name, _, count = path.stem.rpartition("-")
        text = source(name).replace(channel, "")
        header, _, body = text.partition("]]")
        body = re.sub(r"--.*", "", body)  # comments name keys as `<prefix>:{e}:<name>`
        fixed = sorted({int(n) for n in re.findall(r"KEYS\[(\d+)\](?!\.\.)", header)})
        tail = sorted({int(n) for n in re.findall(r"KEYS\[(\d+)\.\.\]", header)})
        used = {int(n) for n in re.findall(r"KEYS\[(\d+)\]", body)}
        if not count.isdigit() or fixed != list(range(1, int(count) + 1)):
            problems.append(f"{path.name}: header lists KEYS {fixed}")
        if tail not in ([], [int(count) + 1]) or (
                tail and not re.search(r"KEYS(,|\[[^\d\]])", body)):
            problems.append(f"{path.name}: variable KEYS {tail}")
        if used - set(fixed):
            problems.append(f"{path.name}: uses KEYS {sorted(used - set(fixed))} not in its header")
        if "sibling_key" in text or "}:" in body or re.search(r"(KEYS\[\d+\]|key) \.\.", body):
            problems.append(f"{path.name}: builds a key from another")
        if re.search(r"(ARGV\[\d+\]|\bprefix) \.\. id\b", body) and not re.search(
                r"Task hashes of ids read here are built from ARGV", header):
            problems.append(f"{path.name}: builds task keys without saying so")
    assert problems == []
