"""What a Redis Cluster changes, checked on one Redis and on a Cluster: a submit's two slots
(the caller's quota and Idempotency-Key, the endpoint's queue) stay exact under races, and
endpoints spread over every master, each served at once by an idle dispatcher."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core import scripts
from app.core.keys import Keys
from app.core.scripts import LUA_DIR
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
    failed: list[int]
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


async def test_a_task_whose_hash_is_not_here_yet_is_never_dropped(gateway: Gateway) -> None:
    """While a reshard moves an endpoint's slot key by key, a script may run on the new master
    before a task's hash has come (it is not named in KEYS). The reaper and the expiry sweep
    leave such an id where it is, to be looked at again, instead of dropping the task."""
    await gateway.add_endpoint("moving", "http://127.0.0.1:9/moving")
    rt, k = gateway.rt, gateway.rt.keys
    lua = rt.queue.scripts
    await rt.redis.zadd(k.active("moving"), {"leased": 1})  # a lease long run out
    await rt.redis.zadd(k.queue("moving"), {"queued": 5})
    await lua.reap(keys=k.of("moving", "active", "queue", "wake", "stats", "outbox",
                                    "hooks", "probe"),
                          args=["moving", k.task_prefix("moving"), 4, 60_000, 1000])
    await lua.expire(keys=k.of("moving", "queue", "stats", "outbox", "deadlines",
                                      "hooks"),
                            args=[k.task_prefix("moving"), 60_000, 100, 100])
    later = await rt.redis.zscore(k.active("moving"), "leased")
    assert later is not None and later > 1  # kept, looked at again later
    assert await rt.redis.zscore(k.queue("moving"), "queued") == 5


def test_every_script_takes_its_keys_in_keys_as_its_name_and_header_say() -> None:
    """A Cluster runs a script only if its caller names every key it touches (docs/design.md,
    "Scaling out"): no script builds a key from another (the events channel is a channel), a
    script's name counts its fixed KEYS and its header lists exactly those (and any variable
    tail, `KEYS[n..]`), and a task key built from a prefix in ARGV is said in the header."""
    assert _script_problems(LUA_DIR) == []


@pytest.mark.parametrize("mutation", [
    "local k = ARGV[1] .. ':q'\nredis.call('ZADD', k, 0, 'x')\n",
    "redis.call('HSET', ARGV[2] .. ':stats', 'a', 1)\n",
    "redis.call('DEL', KEYS[1], 'qgw:' .. ARGV[1])\n",
    "stats_observe(ARGV[1] .. ':stats', 'queue_wait_ms', 1)\n",
], ids=["through-a-name", "direct", "second-key", "through-an-include"])
def test_the_key_guard_sees_a_key_built_from_argv(
    mutation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard above catches a script that builds a key from ARGV (a copy of lua/ with
    one such line added to submit), not only one built from KEYS."""
    lua = tmp_path / "lua"
    shutil.copytree(LUA_DIR, lua)
    monkeypatch.setattr(scripts, "LUA_DIR", lua)  # the includes inlined are the copy's
    assert _script_problems(lua) == []
    path = lua / "submit-11.lua"
    path.write_text(path.read_text().replace("--@include stats.lua\n",
                                             "--@include stats.lua\n" + mutation))
    assert [p for p in _script_problems(lua) if "built key" in p], mutation


def _script_problems(lua_dir: Path) -> list[str]:
    """What the guard finds wrong in the scripts of `lua_dir`."""
    channel = (lua_dir / "includes" / "events.lua").read_text()
    channel = channel[channel.index("local function event_channel"):]
    channel = channel[:channel.index("end\n") + 4]
    problems = []
    for path in sorted(lua_dir.glob("*.lua")):
        count = path.stem.rpartition("-")[2]
        # What source() gives, read afresh (source is cached) from this directory.
        text = scripts._resolve(path).replace(channel, "")
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
        problems += [f"{path.name}: {p}" for p in _built_keys(body)]
    return problems


def _args(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose `(` is at text[start - 1] (strings
    blanked to '' so their commas and dots do not count)."""
    out: list[str]
    depth, out, arg, i = 0, [], "", start
    while i < len(text):
        c = text[i]
        if c in "'\"":
            end = text.index(c, i + 1)
            arg, i = arg + "''", end + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return [*out, arg.strip()]
            depth -= 1
        elif c == "," and depth == 0:
            out, arg, i = [*out, arg.strip()], "", i + 1
            continue
        arg, i = arg + c, i + 1
    raise AssertionError("unclosed call")


_TASK_HASH = re.compile(r"(ARGV\[\d+\]|prefix) \.\. id")  # the documented task-key prefix


def _built_keys(body: str) -> list[str]:
    """Keys reaching redis.call (or an include's function that passes its parameter on to
    it) as a string concatenation, directly or through a name assigned one: on a Cluster such a
    key is not among those the caller named. Exceptions: a task hash from the prefix in ARGV
    (said in the header, checked above) and the PUBLISH channel."""
    built = {m.group(1).split(".")[-1]: m.group(2)
             for m in re.finditer(r"^\s*(?:local\s+)?([\w.]+)\s*=\s*(.*\.\..*)$", body, re.M)}

    def concatenated(expr: str) -> bool:
        expr = re.sub(r"'[^']*'|\"[^\"]*\"", "''", expr)
        if ".." in expr:
            return not _TASK_HASH.fullmatch(expr)
        name = re.sub(r"\[.*", "", expr).split(".")[-1]
        return name in built and not _TASK_HASH.fullmatch(built[name].strip())

    problems, passes = [], {}  # function -> index of a parameter used as a key
    for m in re.finditer(r"redis\.p?call\(\s*(?:'(\w+)')?", body):
        cmd, (_, *args) = m.group(1), _args(body, m.start() + m.group(0).index("(") + 1)
        keys = args if cmd in ("DEL", "EXISTS") else [] if cmd == "PUBLISH" else args[:1]
        problems += [f"redis.call('{cmd}', {key}, ...) on a built key" for key in keys
                     if concatenated(key)]
        fn = list(re.finditer(r"function (\w+)\(([^)]*)\)", body[:m.start()]))
        if fn and keys and (params := [p.strip() for p in fn[-1].group(2).split(",")]) \
                and keys[0] in params:
            passes[fn[-1].group(1)] = params.index(keys[0])
    for fname, i in passes.items():
        for m in re.finditer(rf"(?<![\w.]){fname}\(", body):
            args = _args(body, m.end())
            if not body[:m.start()].endswith("function ") and len(args) > i \
                    and ".." in re.sub(r"'[^']*'", "''", args[i]):
                problems.append(f"{fname}(...) given a built key {args[i]}")
    return problems
