"""`qgw` from the shell: every command listed with help, the admin API's validation, admin
commands on the gateway's own data (never a new empty one), operator actions on tasks."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from app import __version__
from app.cli import build_parser
from app.runtime import Runtime
from tests.conftest import Gateway
from tests.servers import QGW, free_port, mock_log


def qgw(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QGW, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


async def aqgw(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`qgw` from a thread: the test's in-process gateway and dispatchers share this event
    loop, and a loop blocked for the command's run would hold whatever they hold meanwhile
    (a SQLite write lock mid-commit: the command then waits on the test itself)."""
    return await asyncio.to_thread(qgw, env, *args, cwd=cwd)


def answer(r: subprocess.CompletedProcess[str]) -> Any:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refusal(r: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one line a refused command says (and nothing on stdout)."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def test_help_lists_every_command_and_option() -> None:
    env = dict(os.environ)
    for group, actions in (("endpoints", "add list show update pause resume rm"),
                           ("keys", "create list revoke"), ("tasks", "show retry cancel")):
        out = qgw(env, group, "--help").stdout
        for action in actions.split():
            assert f"    {action} " in out, (group, action, out)
    top = qgw(env, "--help").stdout
    for command in "serve api dispatcher migrate mock-upstream endpoints keys tasks".split():
        assert f"    {command}" in top
    version = qgw(env, "--version")
    assert version.returncode == 0 and __version__ in version.stdout
    assert "{sliding_window,fixed_window,token_bucket}" in qgw(env, "endpoints", "add",
                                                               "--help").stdout

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        assert parser.description, f"{path} --help has no description"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction):
                what = f"{path} {action.option_strings or action.dest}"
                assert action.help, f"{what} has no help"
                if action.option_strings and action.default not in (None, argparse.SUPPRESS):
                    assert "default" in action.help, f"{what} does not say its default"

    walk(build_parser(), "qgw")


async def test_endpoint_commands_apply_the_api_rules(gateway: Gateway, env: dict[str, str]) -> None:
    url = "http://127.0.0.1:9/cli"
    added = answer(await aqgw(env, "endpoints", "add", "cli", url, "--rate", "5", "--methods",
                              "post,get", "--enabled", "no"))
    assert added["enabled"] is False and added["methods"] == ["POST", "GET"]
    enabled = answer(await aqgw(env, "endpoints", "update", "cli", "--enabled", "yes"))
    assert enabled["enabled"] is True
    assert answer(await aqgw(env, "endpoints", "show", "cli"))["rate"] == 5
    r = await gateway.http.get("/admin/v1/endpoints/cli", headers=gateway.admin)
    assert r.json()["enabled"] is True and r.json()["methods"] == ["POST", "GET"]

    # What the admin API answers 422 to, the CLI refuses with the same message (exit 2).
    api = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                  json={"user_id": -3})
    assert api.status_code == 422
    line = refusal(await aqgw(env, "keys", "create", "--user-id", "-3"), code=2)
    assert api.json()["error"]["message"] in line
    assert "target_url" in refusal(await aqgw(env, "endpoints", "add", "x", "ftp://a/b"), code=2)
    assert "rate" in refusal(await aqgw(env, "endpoints", "update", "cli", "--rate", "-1"), code=2)
    for bad in (("--enabled", "maybe"), ("--limiter", "leaky")):
        # One line naming the argument, not the usage block above it.
        line = refusal(await aqgw(env, "endpoints", "update", "cli", *bad), code=2)
        assert bad[0] in line and "usage:" not in line, line
    assert "exists" in refusal(await aqgw(env, "endpoints", "add", "cli", url))
    assert [k["user_id"] for k in answer(await aqgw(env, "keys", "list"))] == []
    made = answer(await aqgw(env, "keys", "create", "--user-id", "7"))
    revoked = answer(await aqgw(env, "keys", "revoke", str(made["id"])))
    assert revoked == {"key_id": str(made["id"]), "revoked": True}
    assert [k["revoked"] for k in answer(await aqgw(env, "keys", "list"))] == [True]
    assert answer(await aqgw(env, "endpoints", "pause", "cli"))["paused"] is True
    assert answer(await aqgw(env, "endpoints", "resume", "cli"))["paused"] is False
    assert answer(await aqgw(env, "endpoints", "rm", "cli")) == {"endpoint": "cli", "deleted": True}
    assert "no endpoint 'cli'" in refusal(await aqgw(env, "endpoints", "show", "cli"))


async def test_endpoint_limits_in_shorthand_or_json(gateway: Gateway,
                                                    env: dict[str, str]) -> None:
    """`--limits` as the help says (3/s, 100/min...) or as the API takes it; `none` clears."""
    async def stored() -> Any:
        return answer(await aqgw(env, "endpoints", "show", "lim"))["limits"]

    second = {"limiter": "sliding_window", "rate": 3, "interval_ms": 1000, "per": "request"}
    answer(await aqgw(env, "endpoints", "add", "lim", "http://127.0.0.1:9/lim", "--limits",
                     "3/s, 100/min:token_bucket,90000/min:cost"))
    assert await stored() == [second, {**second, "limiter": "token_bucket", "rate": 100,
                                 "interval_ms": 60_000},
                        {**second, "rate": 90_000, "interval_ms": 60_000, "per": "cost"}]
    answer(await aqgw(env, "endpoints", "update", "lim", "--limits",
                      '[{"rate": 3}, {"rate": 2000, "interval_ms": 86400000}]'))
    r = await gateway.http.get("/admin/v1/endpoints/lim", headers=gateway.admin)
    assert r.json()["limits"] == [second, {**second, "rate": 2000, "interval_ms": 86_400_000}]
    answer(await aqgw(env, "endpoints", "update", "lim", "--limits", "none"))
    assert await stored() == []

    # A bad limit: the admin API's message, in one line, exit 2; nothing changes.
    api = await gateway.http.patch("/admin/v1/endpoints/lim", headers=gateway.admin,
                                   json={"limits": [{"rate": 0, "interval_ms": 1000}]})
    assert api.status_code == 422
    assert api.json()["error"]["message"] in refusal(
        await aqgw(env, "endpoints", "update", "lim", "--limits", "0/s"), code=2)
    assert "'3/fortnight' is not a limit" in refusal(
        await aqgw(env, "endpoints", "update", "lim", "--limits", "3/s,3/fortnight"), code=2)
    assert "limiter" in refusal(
        await aqgw(env, "endpoints", "update", "lim", "--limits", "3/s:leaky"), code=2)
    assert await stored() == []


async def test_read_only_commands_read_sql_only_and_say_nothing_else(
    gateway: Gateway, env: dict[str, str]
) -> None:
    await gateway.add_endpoint("ro", "http://127.0.0.1:9/ro")
    nowhere = {**env, "QGW_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    for args in (("endpoints", "list"), ("endpoints", "show", "ro"), ("keys", "list")):
        r = await aqgw(nowhere, *args)
        assert r.returncode == 0 and r.stderr == "", r.stderr  # no INFO lines, no migration
    assert [e["id"] for e in answer(await aqgw(nowhere, "endpoints", "list"))] == ["ro"]
    # A write needs Redis (every replica must hear of it): one line saying so.
    line = refusal(await aqgw(nowhere, "keys", "create", "--user-id", "1"))
    assert "cannot reach Redis" in line and "QGW_REDIS_URL" in line


def test_admin_commands_elsewhere_refuse_instead_of_a_new_data_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}
    for args in (("endpoints", "list"), ("keys", "create", "--user-id", "1")):
        line = refusal(qgw(env, *args, cwd=tmp_path))
        assert "no database" in line and "QGW_DATA_DIR" in line
    assert list(tmp_path.iterdir()) == []


async def test_operator_shows_retries_and_cancels_any_users_task(
    gateway: Gateway, env: dict[str, str], fresh_upstream: str,
    start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{fresh_upstream}/op"
    await gateway.add_endpoint("op", url)
    auth = await gateway.new_key(user_id=42)
    failing = await gateway.submit(auth, url, body="b", headers={"X-Mock-Status": ["400"]})
    waiting = await gateway.submit(auth, url, body="w", priority=1)
    tid, wid = failing["task_id"], waiting["task_id"]

    shown = answer(await aqgw(env, "tasks", "show", wid))
    assert shown["user_id"] == 42 and shown["endpoint"] == "op"
    assert shown["task_status"] == "pending" and shown["request"]["priority"] == 1
    assert answer(await aqgw(env, "tasks", "cancel", wid))["task_status"] == "cancelled"
    assert "cancelled" in refusal(await aqgw(env, "tasks", "cancel", wid))
    # not failed: nothing to retry
    assert "pending" in refusal(await aqgw(env, "tasks", "retry", tid))

    await start_dispatcher()
    (first,) = await gateway.wait_finished(auth, [tid])
    assert first["task_status"] == "failed" and first["attempts"] == 1
    retried = answer(await aqgw(env, "tasks", "retry", tid))
    assert retried["task_status"] == "pending"
    for _ in range(100):  # it runs again, counted afresh
        if len(mock_log(fresh_upstream)) == 2:
            break
        await asyncio.sleep(0.05)
    (again,) = await gateway.wait_finished(auth, [tid])
    assert again["task_status"] == "failed" and again["attempts"] == 1
    assert [c["body"] for c in mock_log(fresh_upstream)] == ["b", "b"]
    assert "no task" in refusal(await aqgw(env, "tasks", "show", "0" * 32 + ".op"))
    for nothing in ("nope", "0" * 32 + ".op"):  # not an id at all, or no such task
        assert "no task" in refusal(await aqgw(env, "tasks", "retry", nothing))


async def test_a_retry_while_another_process_holds_the_database_answers_and_exits(
    gateway: Gateway, env: dict[str, str], fresh_upstream: str, sqlite_file: Path,
    start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    """The retry forgets the task's old row as a best effort, bounded (here 1 s); SQLite's
    write lock held elsewhere, that statement was still closing its connection (behind the
    busy timeout, 5 s) when the command ended, and the command never exited (app/db.py
    `settle`). The lock is held until the command has answered and exited."""
    url = f"{fresh_upstream}/locked"
    await gateway.add_endpoint("locked", url)
    auth = await gateway.new_key(user_id=5)
    tid = (await gateway.submit(auth, url, body="b", headers={"X-Mock-Status": ["400"]}))[
        "task_id"]
    await start_dispatcher()
    (first,) = await gateway.wait_finished(auth, [tid])
    assert first["task_status"] == "failed"
    held, release = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:  # another process's writer, stuck mid-transaction
        try:
            conn = sqlite3.connect(sqlite_file, isolation_level=None, timeout=10)
            conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            failed.append(exc)
            held.set()
            return
        held.set()
        release.wait(90)
        conn.execute("COMMIT")
        conn.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert await asyncio.to_thread(held.wait, 15) and not failed, failed
        bounded = {**env, "QGW_SQL_TIMEOUT_S": "1"}
        retried = answer(await aqgw(bounded, "tasks", "retry", tid))  # hung: fails at 60 s
    finally:
        release.set()
        await asyncio.to_thread(holder.join)
    assert retried["task_status"] == "pending"
    (again,) = await gateway.wait_finished(auth, [tid])
    assert again["task_status"] == "failed" and len(mock_log(fresh_upstream)) == 2


async def test_paused_endpoint_accepts_submits_and_dispatches_after_resume(
    gateway: Gateway, env: dict[str, str], upstream: str,
    start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{upstream}/paused"
    await gateway.add_endpoint("paused", url)
    auth = await gateway.new_key()
    await start_dispatcher()
    answer(await aqgw(env, "endpoints", "pause", "paused"))
    await asyncio.sleep(1.2)  # every replica has seen it (registry SPREAD_S)
    task = await gateway.submit(auth, url)
    await asyncio.sleep(1.0)
    assert (await gateway.status(auth, task["task_id"]))["task_status"] == "pending"
    answer(await aqgw(env, "endpoints", "resume", "paused"))
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=10)
    assert done["task_status"] == "completed"


async def test_operator_lists_an_endpoints_tasks_and_purges_them(
    gateway: Gateway, env: dict[str, str], upstream: str,
) -> None:
    url = f"{upstream}/cli-purge"
    await gateway.add_endpoint("cli-purge", url)
    auth = await gateway.new_key(user_id=9)
    ids = [(await gateway.submit(auth, url, priority=p))["task_id"] for p in (0, 1, 0)]
    page = answer(await aqgw(env, "tasks", "list", "cli-purge", "--limit", "2"))
    assert [t["task_id"] for t in page["tasks"]] == [ids[1], ids[0]] and page["total"] == 3
    rest = answer(await aqgw(env, "tasks", "list", "cli-purge", "--cursor", page["next_cursor"]))
    assert [t["task_id"] for t in rest["tasks"]] == [ids[2]] and rest["next_cursor"] is None
    assert answer(await aqgw(env, "endpoints", "purge", "cli-purge")) == {
        "endpoint": "cli-purge", "cancelled": 3}
    assert answer(await aqgw(env, "tasks", "list", "cli-purge"))["tasks"] == []
    assert "no endpoint" in refusal(await aqgw(env, "endpoints", "purge", "nope"))
    assert "--limit" in refusal(await aqgw(env, "tasks", "list", "cli-purge", "--limit", "0"), 2)
