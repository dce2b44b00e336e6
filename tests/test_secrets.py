"""Credentials held by the gateway (app/secrets.py): an endpoint's `upstream_headers` reach its
upstream on every call, never come from a caller, are stored only encrypted, and nobody reads
them back: not the admin API, the dashboard, metrics, the CLI, the logs, SQL or Redis."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from app import logs, migrate, secrets
from app.redis_url import parse as parse_redis_url
from app.secrets import key_id, new_key, parse_key, sealed_by
from app.settings import Settings
from tests import test_cli
from tests.conftest import ADMIN
from tests.servers import QGW, MariaDB, free_port, stop, wait_port

SECRET = "sk-" + uuid.uuid4().hex + "-do-not-show"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def needles(secret: str = SECRET) -> list[bytes]:
    """The secret as bytes, and in base64 (alone and in its header line, every alignment)."""
    out = [secret.encode()]
    for text in (secret, f"Bearer {secret}"):
        for pad in ("", "x", "xy"):
            enc = base64.b64encode((pad + text).encode())
            out.append(enc[4 * (len(pad) > 0):-4].rstrip(b"="))  # the part that never varies
            out.append(base64.urlsafe_b64encode((pad + text).encode())[4:-4])
    return out


def found_in(data: bytes, secret: str = SECRET) -> bool:
    return any(n in data for n in needles(secret))


class RawUpstream:
    """A business API that keeps each request as it came, byte for byte (the mock upstream
    keeps a dict of headers: it could not show a header sent twice)."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 11\r\n\r\n{\"ok\":true}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    def headers(self, i: int) -> list[tuple[str, str]]:
        lines = self.requests[i].split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
        return [(n.strip().lower(), v.strip()) for n, _, v in (x.partition(":") for x in lines)]


@pytest.fixture
async def raw_upstream() -> AsyncIterator[tuple[RawUpstream, str]]:
    up = RawUpstream()
    url = await up.start()
    yield up, url
    assert up.server is not None
    up.server.close()


class Serve:
    """`qgw serve` (API and dispatcher) with its logs kept in a file, at debug level."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log_path, self.port = env, log, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, **extra: str) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen([*QGW, "serve", "--port", str(self.port)],
                                         env={**self.env, "QGW_LOG_LEVEL": "debug", **extra},
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_port(self.port, 30, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@pytest.fixture
def serve(env: dict[str, str], tmp_path: Path) -> Iterator[Serve]:
    s = Serve(env, tmp_path / "serve.log")
    yield s
    s.stop()


def qgw(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """tests/test_cli.py's, with `extra` variables set (a key, a provider's secret)."""
    return test_cli.qgw({**env, **extra}, *args)


async def aqgw(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return await test_cli.aqgw({**env, **extra}, *args)


async def wait_done(client: httpx.AsyncClient, auth: dict[str, str], task_id: str
                    ) -> dict[str, Any]:
    for _ in range(300):
        r = await client.get(f"/api/v1/tasks/{task_id}", headers=auth)
        body: dict[str, Any] = r.json()
        if body["task_status"] not in ("pending", "processing"):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"task {task_id} unfinished")


def redis_dumps(url: str, prefix: str) -> dict[bytes, bytes]:
    """Every key of this gateway (its prefix), on every master: its DUMP (taken with RDB
    compression off, so that a value is not hidden by LZF) and its values read by type."""
    target = parse_redis_url(url)
    client: Any
    if target.kind == "cluster":
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts])  # type: ignore[no-untyped-call]  # untyped in redis-py
        nodes = [redis.Redis(n.host, n.port) for n in client.get_nodes()]
    else:
        client = redis.Redis.from_url(url)
        nodes = [client]
    try:
        for node in nodes:
            node.config_set("rdbcompression", "no")
        keys = set(client.scan_iter(match=f"{prefix}*", count=1000))
        assert keys, "no key found: the search would prove nothing"
        return {k: (client.dump(k) or b"") + repr(_read(client, k)).encode() for k in keys}
    finally:
        for node in nodes:
            node.close()
        client.close()


def _read(client: Any, key: bytes) -> Any:
    kind = client.type(key).decode()
    read = {"string": client.get, "hash": client.hgetall, "set": client.smembers,
            "list": lambda k: client.lrange(k, 0, -1),
            "zset": lambda k: client.zrange(k, 0, -1, withscores=True),
            "stream": lambda k: client.xrange(k)}
    return read[kind](key) if kind in read else None


async def _offline_call(client: httpx.AsyncClient, target: str, read: bool = True) -> str:
    """A task through the gateway, finished; unless `read`, its owner has not read it (so it
    stays for the operator's views: a result read is let go)."""
    r = await client.post("/admin/v1/api-keys", headers=ADMIN_AUTH, json={"user_id": 7})
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    r = await client.post("/api/v1/tasks", headers=auth, json={
        "target_url": target, "body": "{}",
        "headers": {"Authorization": ["Bearer caller-token"], "Anthropic-Version": ["caller"]}})
    assert r.status_code == 202, r.text
    task_id: str = r.json()["task_id"]
    if read:
        assert (await wait_done(client, auth, task_id))["task_status"] == "completed"
        return task_id
    for _ in range(300):
        shown = (await client.get(f"/admin/v1/tasks/{task_id}", headers=ADMIN_AUTH)).json()
        if shown["task_status"] == "completed":
            return task_id
        await asyncio.sleep(0.1)
    raise AssertionError(f"task {task_id} unfinished")


@pytest.mark.backends("single", "cluster")
async def test_the_upstream_gets_the_credentials_and_nobody_reads_them_back(
    serve: Serve, env: dict[str, str], settings: Settings, tmp_path: Path, sqlite_file: Path,
    raw_upstream: tuple[RawUpstream, str],
) -> None:
    up, base = raw_upstream
    target = f"{base}/v1/chat"
    assert (await aqgw(env, "migrate")).returncode == 0
    # Added from the CLI: its output is searched too.
    added = await aqgw(env, "endpoints", "add", "llm", target, "--forward-headers",
                       "Authorization,Anthropic-Version",
                       "--upstream-header", f"Authorization: Bearer {SECRET}",
                       "--upstream-header", "anthropic-version: 2023-06-01")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["upstream_headers"] == {
        "Authorization": "<set>", "anthropic-version": "<set>"}
    serve.start()
    async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
        task_id = await _offline_call(client, target, read=False)
        got = up.headers(-1)
        # The endpoint's values, once each; the caller's same-named headers are dropped.
        assert [v for n, v in got if n == "authorization"] == [f"Bearer {SECRET}"]
        assert [v for n, v in got if n == "anthropic-version"] == ["2023-06-01"]
        # An answer sent back as it is keeps the values ("<set>" keeps, names stay).
        shown = (await client.get("/admin/v1/endpoints/llm", headers=ADMIN_AUTH)).json()
        shown.pop("id")
        r = await client.put("/admin/v1/endpoints/llm", headers=ADMIN_AUTH, json=shown)
        assert r.status_code == 200, r.text
        await asyncio.sleep(1.2)  # the change reaches the dispatcher (registry.SPREAD_S)
        await _offline_call(client, target)
        assert [v for n, v in up.headers(-1) if n == "authorization"] == [f"Bearer {SECRET}"]
        answers = [await client.get(path, headers=ADMIN_AUTH) for path in (
            "/admin/v1/endpoints", "/admin/v1/endpoints/llm", "/admin/v1/queues",
            f"/admin/v1/tasks/{task_id}", "/admin/v1/endpoints/llm/tasks?status=completed",
            "/admin/v1/overview", "/admin/v1/history?endpoints=llm", "/dashboard",
            "/dashboard/app.js", "/metrics", "/openapi.json",
            # The operator's search across endpoints, which shows each task's request.
            "/admin/v1/tasks", "/admin/v1/tasks?status=completed&endpoint=llm",
            f"/admin/v1/tasks?id={task_id[:8]}")]
        hook = await _webhook_delivery(client, up, base, target)
    assert [(a.url.path, a.status_code) for a in answers if a.status_code != 200] == []
    assert task_id in answers[-1].text  # the search found the task, request and all
    assert answers[1].json()["upstream_headers"] == {"Authorization": "<set>",
                                                     "anthropic-version": "<set>"}
    cli = [await aqgw(env, *args) for args in (("endpoints", "list"),
                                               ("endpoints", "show", "llm"),
                                               ("tasks", "show", task_id))]
    assert all(c.returncode == 0 for c in cli), [c.stderr for c in cli]
    serve.stop()  # its logs complete
    seen = {f"answer {a.url}": a.content for a in answers} | {"webhook delivery": hook}
    seen |= {f"cli {c.args[3:]}": (c.stdout + c.stderr).encode() for c in [added, *cli]}
    seen |= {f"redis {k!r}": v for k, v in redis_dumps(env["QGW_REDIS_URL"],
                                                        settings.key_prefix).items()}
    files = _files(tmp_path) | _files(sqlite_file.parent)
    assert sqlite_file in files and serve.log_path in files
    seen |= {f"file {p}": data for p, data in files.items()}
    assert [where for where, data in seen.items() if found_in(data)] == []
    for prefix in (b"", b"a", b"ab"):  # the search finds it wherever base64 puts it
        line = prefix + f"Authorization: Bearer {SECRET}".encode()
        assert found_in(base64.b64encode(line)) and found_in(base64.urlsafe_b64encode(line))


async def _webhook_delivery(client: httpx.AsyncClient, up: RawUpstream, base: str,
                            target: str) -> bytes:
    """The webhook a finished task of the endpoint sends its caller, as it came (the raw
    upstream takes it: a path of its own)."""
    r = await client.post("/admin/v1/api-keys", headers=ADMIN_AUTH,
                          json={"user_id": 8, "callback_urls": [f"{base}/hooks/"]})
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    r = await client.post("/api/v1/tasks", headers=auth, json={
        "target_url": target, "body": "{}", "callback_url": f"{base}/hooks/done"})
    assert r.status_code == 202, r.text
    for _ in range(300):
        hooks = [raw for raw in up.requests if raw.startswith(b"POST /hooks/done ")]
        if hooks:
            assert r.json()["task_id"].encode() in hooks[0]
            return hooks[0]
        await asyncio.sleep(0.1)
    raise AssertionError("no webhook delivered")


def _files(root: Path) -> dict[Path, bytes]:
    """Every file of the test's data dir: the SQLite database (and its journal), the logs."""
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def test_a_mariadb_dump_holds_no_credential(mariadb: MariaDB, settings: Settings,
                                                  tmp_path: Path) -> None:
    from app.runtime import Runtime

    url = mariadb.create_database(f"s{uuid.uuid4().hex[:12]}")
    await asyncio.to_thread(migrate.upgrade, url)
    rt = Runtime(settings.model_copy(update={"database_url": url}))
    await rt.start()
    try:
        from app.endpoints import EndpointConfig

        await rt.endpoints.create(EndpointConfig.model_validate({
            "id": "llm", "target_url": "http://127.0.0.1:9/v1",
            "upstream_headers": {"Authorization": f"Bearer {SECRET}"}}))
        stored = await rt.endpoints.get("llm")
    finally:
        await rt.stop()
    assert stored.upstream_headers["Authorization"].startswith("qgw1.")  # sealed, in this process
    dump = subprocess.run(["mariadb-dump", "-h", "127.0.0.1", "-P", str(mariadb.port), "-u",
                           "root", url.rsplit("/", 1)[1]], capture_output=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert b"upstream_headers" in dump.stdout and b"qgw1." in dump.stdout
    assert not found_in(dump.stdout)


BAD = [
    ({"Host": "api.example"}, "Host"), ({"Content-Length": "5"}, "Content-Length"),
    ({"Transfer-Encoding": "chunked"}, "Transfer-Encoding"),
    ({"connection": "close"}, "connection"), ({"Keep-Alive": "5"}, "Keep-Alive"),
    ({"Upgrade": "h2c"}, "Upgrade"), ({"TE": "trailers"}, "TE"),
    ({"Proxy-Authorization": "Basic x"}, "Proxy-Authorization"),
    ({"X-Queue-Priority": "1"}, "X-Queue-Priority"),
    ({"Idempotency-Key": "k"}, "Idempotency-Key"),
    ({"Authorization: Bearer": SECRET}, "header name"), ({"Bad Name": "v"}, "header name"),
    # Over 128 characters: the name (here holding the value) is not echoed either.
    ({f"Authorization: Bearer {SECRET}{'x' * 80}": "x"}, "header name"),
    ({f"Authorization: Bearer {SECRET}": 5}, "upstream_headers"),
    ({"X-Ok": f"{SECRET}\r\nX-Injected: 1"}, "control character"),
    ({"X-Ok": f"{SECRET}\n"}, "control character"), ({"X-Ok": f"a\x00{SECRET}"}, "control"),
    ({"X-Ok": ""}, "at least 1"), ({"X-Ok": "a", "x-ok": "b"}, "twice"),
    ({"X-Ok": "<set>"}, "no value for it"), ({"X-Ok": "é" * 2049}, "over 4096 bytes"),
    ({"X-Ok": "x" * 6001}, "at most 6000"),
]


@pytest.mark.parametrize(("headers", "says"), BAD)
async def test_headers_that_cannot_be_set_are_refused_with_422(
    gateway: Any, headers: dict[str, str], says: str
) -> None:
    body = {"target_url": "http://127.0.0.1:9/bad", "upstream_headers": headers}
    r = await gateway.http.post("/admin/v1/endpoints", headers=gateway.admin,
                                json={"id": "bad", **body})
    await gateway.add_endpoint("good", "http://127.0.0.1:9/good")
    put = await gateway.http.put("/admin/v1/endpoints/good", headers=gateway.admin, json=body)
    patch = await gateway.http.patch("/admin/v1/endpoints/good", headers=gateway.admin,
                                     json={"upstream_headers": headers})
    for answer in (r, put, patch):
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_request" and says in error["message"], error
        assert SECRET not in answer.text  # a refused value is not echoed


def test_cli_update_sets_and_removes_one_header_and_keeps_the_others(
    env: dict[str, str], tmp_path: Path
) -> None:
    assert qgw(env, "migrate").returncode == 0
    add = qgw(env, "endpoints", "add", "llm", "http://127.0.0.1:9/v1",
              "--upstream-header", "Authorization: Bearer one", "--upstream-header", "X-Org: o")
    assert add.returncode == 0, add.stderr
    upd = qgw(env, "endpoints", "update", "llm", "--upstream-header", "X-Org:",
              "--upstream-header", "X-Project: p")
    assert upd.returncode == 0, upd.stderr
    assert json.loads(upd.stdout)["upstream_headers"] == {"Authorization": "<set>",
                                                          "X-Project": "<set>"}
    bad = qgw(env, "endpoints", "update", "llm", "--upstream-header", "Host: x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Host" in bad.stderr
    bad = subprocess.run([*QGW, "endpoints", "update", "llm", "--upstream-header",
                          b"X-Raw: \xff\xfe"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr  # not text
    bad = qgw(env, "endpoints", "update", "llm", "--upstream-header", "no colon")
    assert bad.returncode == 2 and "Name: value" in bad.stderr


async def test_cli_takes_a_value_from_the_environment_or_a_file_not_the_command_line(
    gateway: Any, env: dict[str, str], tmp_path: Path
) -> None:
    key_file = tmp_path / "provider-key"
    key_file.write_text(f"{SECRET}-from-file\n")
    key_file.chmod(0o600)
    args = ["endpoints", "add", "llm", "http://127.0.0.1:9/v1",
            "--upstream-header", "Authorization: @env:PROVIDER_KEY",
            "--upstream-header", f"X-Org: @file:{key_file}"]
    assert not any(SECRET in a for a in args)  # nothing for ps or the shell history to keep
    add = await aqgw(env, *args, PROVIDER_KEY=f"Bearer {SECRET}")
    assert add.returncode == 0, add.stderr
    assert not found_in((add.stdout + add.stderr).encode())
    stored = (await gateway.rt.endpoints.get("llm")).upstream_headers
    ring = gateway.rt.settings.keyring
    assert ring.open("llm", "Authorization", stored["Authorization"]) == f"Bearer {SECRET}"
    assert ring.open("llm", "X-Org", stored["X-Org"]) == f"{SECRET}-from-file"
    for value, says in (("@env:NOT_SET_ANYWHERE", "NOT_SET_ANYWHERE"),
                        (f"@file:{tmp_path / 'missing'}", "missing"),
                        ("@file:/dev/zero", "more than a value may")):  # read to 4 KiB, no more
        bad = await aqgw(env, "endpoints", "update", "llm", "--upstream-header", f"X-Org: {value}")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and says in bad.stderr


def test_keys_are_hex_or_base64_of_32_bytes() -> None:
    raw = bytes(range(32))
    for text in (raw.hex(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw)
                 .decode().rstrip("="), new_key()):
        assert len(parse_key(text)) == 32
    assert parse_key(raw.hex()) == raw
    for bad in ("", "short", raw.hex()[:-2], base64.b64encode(raw + b"x").decode(), "z" * 64):
        with pytest.raises(ValueError, match="32 bytes"):
            parse_key(bad)


def _sealed_ids(dump: dict[bytes, bytes]) -> set[str]:
    return {kid for data in dump.values() for kid in
            {sealed_by(t.decode()) for t in _tokens(data)} if kid}


def _tokens(data: bytes) -> list[bytes]:
    import re

    return re.findall(rb"qgw1\.[0-9a-f]{12}\.[A-Za-z0-9_-]+", data)


@pytest.mark.backends("single", "cluster")
async def test_rotation_keeps_calls_working_while_it_runs(
    serve: Serve, env: dict[str, str], settings: Settings, tmp_path: Path, sqlite_file: Path,
    raw_upstream: tuple[RawUpstream, str],
) -> None:
    up, base = raw_upstream
    target = f"{base}/v1/rotate"
    old, new = new_key(), new_key()
    assert (await aqgw(env, "migrate")).returncode == 0
    added = await aqgw(env, "endpoints", "add", "llm", target, "--upstream-header",
                       f"Authorization: Bearer {SECRET}", QGW_SECRETS_KEY=old)
    assert added.returncode == 0, added.stderr
    both = {"QGW_SECRETS_KEY": new, "QGW_SECRETS_KEY_PREVIOUS": old}
    serve.start(**both)  # processes restarted with the new key first, the old one beside it
    async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
        r = await client.post("/admin/v1/api-keys", headers=ADMIN_AUTH, json={"user_id": 7})
        auth = {"Authorization": f"Bearer {r.json()['key']}"}
        rotating = asyncio.create_task(asyncio.to_thread(qgw, env, "secrets", "rotate", **both))
        ids: list[str] = []
        while not rotating.done() or len(ids) < 20:
            r = await client.post("/api/v1/tasks", headers=auth,
                                  json={"target_url": target, "body": "{}"})
            ids.append(r.json()["task_id"])
            await asyncio.sleep(0.05)
        rotated = await rotating
        for _ in range(10):  # and on, after the mirror has the new values everywhere
            r = await client.post("/api/v1/tasks", headers=auth,
                                  json={"target_url": target, "body": "{}"})
            ids.append(r.json()["task_id"])
            await asyncio.sleep(0.15)
        done = [await wait_done(client, auth, t) for t in ids]
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout) == {"key_id": key_id(parse_key(new)), "endpoints": 1,
                                          "resealed": 1}
    assert {d["task_status"] for d in done} == {"completed"}, [d.get("error") for d in done]
    sent = [v for i in range(len(up.requests)) for n, v in up.headers(i) if n == "authorization"]
    assert len(sent) == len(ids) and set(sent) == {f"Bearer {SECRET}"}
    # Everything is sealed with the new key now: SQL and the Redis mirror.
    db = await asyncio.to_thread(sqlite_file.read_bytes)
    mirror = redis_dumps(env["QGW_REDIS_URL"], settings.key_prefix)
    assert {sealed_by(t.decode()) for t in _tokens(db)} >= {key_id(parse_key(new))}
    assert _sealed_ids(mirror) == {key_id(parse_key(new))}
    again = await aqgw(env, "secrets", "rotate", **both)
    assert json.loads(again.stdout)["resealed"] == 0
    # Without the old key a process still calls with the credentials.
    serve.stop()
    serve.start(QGW_SECRETS_KEY=new)
    async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
        await _offline_call(client, target)
    assert [v for n, v in up.headers(-1) if n == "authorization"] == [f"Bearer {SECRET}"]


def test_rotation_without_the_old_key_says_which_key_is_missing(env: dict[str, str]) -> None:
    assert qgw(env, "migrate").returncode == 0
    old, new = new_key(), new_key()
    assert qgw(env, "endpoints", "add", "llm", "http://127.0.0.1:9/v1", "--upstream-header",
               "Authorization: x", QGW_SECRETS_KEY=old).returncode == 0
    r = qgw(env, "secrets", "rotate", QGW_SECRETS_KEY=new)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert key_id(parse_key(old)) in r.stderr and "QGW_SECRETS_KEY_PREVIOUS" in r.stderr


def test_a_generated_key_is_kept_in_the_data_dir_and_a_damaged_one_is_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    assert qgw(env, "migrate").returncode == 0
    add = qgw(env, "endpoints", "add", "llm", "http://127.0.0.1:9/v1", "--upstream-header",
              "Authorization: x")
    assert add.returncode == 0, add.stderr
    key_file = tmp_path / "secrets_key"
    assert len(parse_key(key_file.read_text())) == 32 and key_file.stat().st_mode & 0o077 == 0
    key_file.write_text("damaged\n")
    for command in (["secrets", "rotate"], ["serve", "--port", str(free_port())]):
        r = qgw(env, *command)  # said before anything starts
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert "secrets_key" in r.stderr and "32 bytes" in r.stderr


def test_values_open_once_per_endpoint_version_and_only_where_they_were_sealed() -> None:
    from app import secrets

    ring = secrets.Keyring(parse_key(new_key()))
    secrets.install(ring)
    token = ring.seal("llm", "Authorization", "Bearer one")
    creds = secrets.Credentials("llm", (("Authorization", token),))
    caller = [("authorization", "Bearer caller"), ("accept", "*/*")]
    before = secrets._opened.cache_info()
    for _ in range(3):
        assert secrets.outgoing(caller, creds) == [("accept", "*/*"),
                                                   ("Authorization", "Bearer one")]
    after = secrets._opened.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)
    # A new write seals anew: the next call opens the new value.
    changed = secrets.Credentials("llm", (("Authorization", ring.seal("llm", "Authorization",
                                                                      "Bearer two")),))
    assert secrets.outgoing([], changed) == [("Authorization", "Bearer two")]
    # Copied onto another endpoint or header, or altered, a value does not open.
    flipped = token[:-10] + ("A" if token[-10] != "A" else "B") + token[-9:]
    for where, name, value in (("other", "Authorization", token), ("llm", "X-Key", token),
                               ("llm", "Authorization", flipped)):
        with pytest.raises(secrets.Undecryptable) as err:
            ring.open(where, name, value)
        assert "Bearer" not in str(err.value)


async def test_a_dispatcher_without_the_key_fails_the_call_and_tells_the_operator_which_key(
    gateway: Any, env: dict[str, str], raw_upstream: tuple[RawUpstream, str], tmp_path: Path
) -> None:
    up, base = raw_upstream
    await gateway.add_endpoint("llm", f"{base}/v1/nokey", max_retries=0,
                               upstream_headers={"X-Provider-Key": f"Bearer {SECRET}"})
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{base}/v1/nokey", body="{}")
    log_file = tmp_path / "dispatcher.log"
    with log_file.open("wb") as err:  # not the key the API sealed with
        proc = subprocess.Popen([*QGW, "dispatcher"], env={**env, "QGW_SECRETS_KEY": new_key()},
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        (done,) = await gateway.wait_finished(auth, [task["task_id"]])
    finally:
        stop(proc)
    assert done["task_status"] == "failed" and up.requests == []
    kid = key_id(gateway.rt.settings.keyring.current)
    # The caller learns that much and no more: no endpoint, header name or key id.
    assert done["task_result"] == "upstream credentials unavailable", done
    assert kid not in json.dumps(done) and "X-Provider-Key" not in json.dumps(done)
    logged = log_file.read_text()  # the operator learns which key is missing, where
    assert kid in logged and "does not hold" in logged and "X-Provider-Key" in logged
    assert task["task_id"] in logged and not found_in(logged.encode())


def test_a_generated_secret_file_is_created_private(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No moment when the file holds the secret and others may read it: with every chmod
    skipped and a umask that restricts nothing, what is created is already 0600."""
    from app import settings as settings_module
    monkeypatch.setattr(Path, "chmod", lambda *a, **k: None)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    old = os.umask(0)
    try:
        for name in ("secrets_key", "admin_token", "permit_secret"):
            value = settings_module._stored_secret(tmp_path / "data", name, new_key)
            path = tmp_path / "data" / name
            assert path.read_text().strip() == value
            assert path.stat().st_mode & 0o777 == 0o600, oct(path.stat().st_mode)
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "admin_token", "permit_secret", "secrets_key"]  # no draft left behind


def test_opened_values_and_the_keys_are_scrubbed_from_log_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value with no credential shape (Ocp-Apim-Subscription-Key), echoed by an upstream's
    error, is scrubbed once this process opened it; so are the keys as configured."""
    value = "azure" + uuid.uuid4().hex
    current, previous = new_key(), bytes(range(32)).hex()
    keyring = Settings(data_dir=tmp_path, secrets_key=current,
                       secrets_key_previous=previous).keyring
    token = keyring.seal("azure", "Ocp-Apim-Subscription-Key", value)
    line = json.dumps({"msg": "upstream answered 401", "body": f"key {value} is not valid"})
    assert value in logs.scrub(line)  # nothing in its shape gives it away
    monkeypatch.setattr(secrets, "_keyring", keyring)
    sent = secrets.outgoing([], secrets.Credentials(
        "azure", (("Ocp-Apim-Subscription-Key", token),)))
    assert sent == [("Ocp-Apim-Subscription-Key", value)]
    assert value not in logs.scrub(line) and logs.REDACTED in logs.scrub(line)
    for key in (current, previous):
        assert key not in logs.scrub(f"started with QGW_SECRETS_KEY {key} in its environment")


class EchoUpstream:
    """A provider whose 401 echoes the key it was sent, as Azure's does: the value of each
    header named in `echo` (a bearer token without its scheme), the first one across the
    200th character of the body, the body written in two pieces cut inside the second."""

    def __init__(self, echo: tuple[str, ...]) -> None:
        self.echo = echo
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                got = {n.strip().lower(): v.strip() for n, _, v in
                       (line.partition(":") for line in head.split("\r\n")[1:] if line)}
                await reader.readexactly(int(got.get("content-length", "0")))
                keys = [got.get(name, "").removeprefix("Bearer ") for name in self.echo]
                body = json.dumps({"error": {"message": "Access denied: " + "x" * 142 + " key "
                                             + " and ".join(keys) + " is not valid"}}).encode()
                writer.write(f"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode())
                cut = body.rindex(keys[-1].encode()) + len(keys[-1]) // 2
                writer.write(body[:cut])
                await writer.drain()
                await asyncio.sleep(0.05)  # apart: two reads for the relay
                writer.write(body[cut:])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


def test_hidden_across_every_cut_of_a_stream_and_scrubbed_across_a_log_cut() -> None:
    echoed = (b"sk-0123456789abcdef", b"0123456789abcdef")
    body = b"a sk-0123456789abcdef, b 0123456789abcdef c 0123456789abcde"
    whole = secrets.hide(body, echoed)
    assert whole == b"a [redacted], b [redacted] c 0123456789abcde"
    for i in range(len(body) + 1):
        for j in range(i, len(body) + 1):
            hider = secrets.Hider(echoed)
            out = b"".join(hider.feed(p) for p in (body[:i], body[i:j], body[j:])) + hider.end()
            assert out == whole, (i, j)
    value = "opaque" + uuid.uuid4().hex
    logs.redact(*secrets.forms(f"Token {value}"))
    text = "x" * 190 + value + " and more"
    assert value[:10] in text[:200] and value[:10] not in logs.clipped(text, 200)
    assert len(logs.clipped(text, 200)) <= 200


async def test_a_key_an_upstream_echoes_reaches_no_caller_and_no_log(
    serve: Serve, env: dict[str, str],
) -> None:
    """An error answer that echoes the endpoint's credentials (a 401 naming the key it got) is
    kept and relayed with them hidden, a bearer token as well, and logged without any of
    them, though the first crosses the log's 200-character cut; a success stays byte-exact
    (the other tests)."""
    plain, token = "azure" + uuid.uuid4().hex, "sk-" + uuid.uuid4().hex
    up = EchoUpstream(("ocp-apim-subscription-key", "authorization"))
    base = await up.start()
    assert (await aqgw(env, "migrate")).returncode == 0
    serve.start()
    try:
        async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
            r = await client.post("/admin/v1/endpoints", headers=ADMIN_AUTH, json={
                "id": "azure", "target_url": f"{base}/v1", "max_retries": 0, "proxy": True,
                "upstream_headers": {"Ocp-Apim-Subscription-Key": plain,
                                     "Authorization": f"Bearer {token}"}})
            assert r.status_code == 201, r.text
            r = await client.post("/admin/v1/api-keys", headers=ADMIN_AUTH, json={"user_id": 7})
            auth = {"Authorization": f"Bearer {r.json()['key']}"}
            await asyncio.sleep(1.2)  # the endpoint reaches the dispatcher (registry.SPREAD_S)
            r = await client.post("/api/v1/tasks", headers=auth,
                                  json={"target_url": f"{base}/v1", "body": "{}"})
            assert r.status_code == 202, r.text
            done = await wait_done(client, auth, r.json()["task_id"])
            proxied = await client.post("/proxy/azure/chat", headers=auth, content=b"{}")
            failed = await client.get("/admin/v1/tasks?status=failed", headers=ADMIN_AUTH)
    finally:
        assert up.server is not None
        up.server.close()
        serve.stop()
    assert done["task_status"] == "failed" and done["result_status_code"] == 401
    assert proxied.status_code == 401
    hidden = f"key {logs.REDACTED} and {logs.REDACTED} is not valid"
    assert hidden in done["task_result"] and hidden in proxied.json()["error"]["message"]
    logged = serve.log_path.read_text()
    assert "task failed" in logged
    for where, text in (("result", done["task_result"]), ("relayed", proxied.text),
                        ("operator", failed.text), ("log", logged)):
        for secret in (plain, token):  # nor the part of one before a cut
            assert not any(secret[:n] in text for n in range(8, len(secret) + 1)), where


async def test_a_rotation_racing_an_edit_leaves_the_newest_row_in_the_mirror(
    gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qgw secrets rotate` and a PATCH of the same endpoint: whichever commits last is what
    the Redis mirror holds, however late the rotation's publication is (here held up to 1 s,
    until the edit has answered)."""
    from app.endpoints import EndpointConfig
    from app.secrets import Keyring

    store = gateway.rt.endpoints
    old, new = parse_key(new_key()), parse_key(new_key())
    monkeypatch.setattr(store, "keyring", Keyring(old))
    await store.create(EndpointConfig.model_validate({
        "id": "llm", "target_url": "http://127.0.0.1:9/v1",
        "upstream_headers": {"Authorization": "Bearer one"}}))
    monkeypatch.setattr(store, "keyring", Keyring(new, old))  # restarted with the new key
    publishing, edited = asyncio.Event(), asyncio.Event()
    put = store.mirror.put

    async def late_put(item_id: str, value: Any, hold_s: float = 0) -> None:
        if not publishing.is_set():  # the rotation's publication
            publishing.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(edited.wait(), 1)
        await put(item_id, value, hold_s)

    monkeypatch.setattr(store.mirror, "put", late_put)
    rotating = asyncio.create_task(store.reseal())
    await publishing.wait()
    await store.update("llm", {"upstream_headers": {"Authorization": "Bearer two"}})
    edited.set()
    assert await rotating == {"endpoints": 1, "resealed": 1}
    sql = (await store.get("llm")).upstream_headers["Authorization"]
    held = json.loads(await gateway.rt.redis.hget(store.mirror.hash_key, "llm"))
    assert held["upstream_headers"]["Authorization"] == sql
    ring = Keyring(new, old)
    assert ring.open("llm", "Authorization", sql) == "Bearer two"
