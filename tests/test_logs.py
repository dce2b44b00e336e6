"""Logs of a real `qgw serve`: JSON lines, task id and endpoint on task lines, never a secret."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import httpx

from app import logs
from app.startup import hide_password
from tests.conftest import ADMIN, Gateway
from tests.servers import QGW, free_port, stop, wait_port

PERMIT_SECRET = "test-permit-secret"


async def _flow(base: str, gateway: Gateway, upstream: str) -> list[str]:
    """Offline success, an immediate failure, retries, an unreachable upstream and an online
    task through its permit; returns the secrets the gateway saw."""
    await gateway.add_endpoint("logged", f"{upstream}/logged", max_retries=1,
                               retry_backoff_ms=0)
    await gateway.add_endpoint("dead", "http://127.0.0.1:9/dead", max_retries=1,
                               retry_backoff_ms=0, timeout_ms=2000)
    await gateway.add_endpoint("live", f"{upstream}/live", max_concurrency=1)
    auth = await gateway.new_key()
    key = auth["Authorization"].removeprefix("Bearer ")
    secrets = [key, ADMIN, PERMIT_SECRET, "querysecret-4711", "bodysecret-0815",
               "escapedsecret-2718"]
    async with httpx.AsyncClient(base_url=base, headers=auth) as http:
        async def submit(url: str, **fields: Any) -> str:
            r = await http.post("/api/v1/tasks", json={"target_url": url, **fields})
            assert r.status_code == 202, r.text
            return str(r.json()["task_id"])

        ids = [
            await submit(f"{upstream}/logged?api_key=querysecret-4711",
                         body="bodysecret-0815", headers={"X-Api-Key": [key]}),
            await submit(f"{upstream}/logged", headers={"X-Mock-Status": ["400"]}),
            # The mock echoes the body in its error answer, which the failure line quotes:
            # a credential inside JSON inside our JSON line, its quotes escaped twice.
            await submit(f"{upstream}/logged", headers={"X-Mock-Status": ["422"]},
                         body=json.dumps({"password": "escapedsecret-2718"})),
            await submit(f"{upstream}/logged", headers={"X-Mock-Status": ["503"]}),
            await submit("http://127.0.0.1:9/dead?token=querysecret-4711"),
        ]
        online = await submit(f"{upstream}/live", task_type="online")
        for _ in range(200):
            s = (await http.get(f"/api/v1/tasks/{online}")).json()
            if s["permit"]:
                break
            await asyncio.sleep(0.05)
        permit = s["permit"]["token"]
        secrets.append(permit)
        check = await http.get("/auth/check", headers={
            "X-Queue-Task-Id": online, "X-Queue-Permit": permit,
            "X-Original-URI": "/live?api_key=querysecret-4711", "X-Original-Method": "POST"})
        assert check.status_code == 200
        assert (await http.post(f"/api/v1/tasks/{online}/complete")).status_code == 200
        assert (await http.get("/admin/v1/queues", headers={
            "Authorization": f"Bearer {ADMIN}"})).status_code == 200
        bad = await http.get("/api/v1/tasks/nope", headers={"Authorization": "Bearer qgw_wrong"})
        assert bad.status_code == 401
        for tid in ids:
            for _ in range(300):
                s = (await http.get(f"/api/v1/tasks/{tid}")).json()
                if s["task_status"] not in ("pending", "processing"):
                    break
                await asyncio.sleep(0.05)
            assert s["task_status"] in ("completed", "failed"), s
    return secrets


async def test_logs_are_json_with_task_fields_and_no_secrets(
    gateway: Gateway, env: dict[str, str], upstream: str, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "stderr.log"
    with log_path.open("wb") as stderr:
        proc = subprocess.Popen([*QGW, "serve", "--port", str(port)],
                                env={**env, "QGW_LOG_LEVEL": "debug"}, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            await asyncio.to_thread(wait_port, port, 30, proc)
            secrets = await _flow(f"http://127.0.0.1:{port}", gateway, upstream)
        finally:
            stop(proc)
    text = log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # all JSON
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    for secret in secrets:
        assert secret not in text, f"a secret reached the logs: {secret[:6]}..."
    about_tasks = [line for line in lines if "task_id" in line]
    assert about_tasks and all(line.get("endpoint") for line in about_tasks)
    messages = {(line["endpoint"], line["msg"].split(" ")[0]) for line in about_tasks}
    # A completion and a failure (debug), and retries (info), each named by task and endpoint.
    assert {("logged", "task"), ("logged", "retrying"), ("dead", "retrying")} <= messages


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("qgw.test", logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_formatters_scrub_what_looks_like_a_secret() -> None:
    logs.redact("an-admin-token-value")
    record = _record(
        "call %s with Authorization: Bearer %s failed; admin=%s permit=%s",
        "http://svc:9000/api?api_key=abc&x=1", "qgw_" + "k" * 43, "an-admin-token-value",
        "1763779200000." + "p" * 43, task_id="0193.e", endpoint="e",
        url="redis://user:pw-secret@redis:6379/0")
    line = json.loads(logs.JsonFormatter().format(record))
    for leak in ("api_key=abc", "k" * 43, "an-admin-token-value", "p" * 43, "pw-secret"):
        assert leak not in json.dumps(line)
    assert line["msg"].startswith("call http://svc:9000/api?[redacted] with Authorization:")
    assert line["task_id"] == "0193.e" and line["endpoint"] == "e"

    text = logs.TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert text.startswith("INFO qgw.test: call http://svc:9000/api?[redacted]")
    assert "task_id=0193.e endpoint=e" in text and "k" * 43 not in text


def test_credentials_are_hidden_whatever_their_name_or_quotes() -> None:
    """Names with a prefix or a number, values with spaces, quotes escaped by nested JSON,
    a quote that never closes; and names that only look alike are left alone."""
    cases = {
        'password="two words" next': 'password="[redacted]" next',
        "db_passwd=abc x": "db_passwd=[redacted] x",
        "password2: s3cr3t": "password2: [redacted]",
        '{"private_key": "-----BEGIN KEY-----"}': '{"private_key": "[redacted]"}',
        'body {\\"client_secret\\": \\"very secret\\"}':
            'body {\\"client_secret\\": \\"[redacted]\\"}',
        'secret="unterminated': 'secret="[redacted]',
        "permit_ttl_s=20 max_retries=3": "permit_ttl_s=20 max_retries=3",
    }
    for line, scrubbed in cases.items():
        assert logs.scrub(line) == scrubbed, line


def test_the_start_banner_hides_url_passwords() -> None:
    assert hide_password("mysql+aiomysql://qgw:pw@db:3306/qgw") == (
        "mysql+aiomysql://qgw:***@db:3306/qgw")
    assert hide_password("redis://:p@ss@cache:6379/0") == "redis://:***@cache:6379/0"
    assert hide_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_failed_migration_says_why_in_one_line_without_the_password(tmp_path: Path) -> None:
    url = f"mysql+aiomysql://qgw:S3cretPw@127.0.0.1:{free_port()}/qgw"
    env = {"QGW_DATABASE_URL": url, "QGW_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([*QGW, "migrate"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "S3cretPw" not in proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("qgw: cannot migrate mysql+aiomysql://qgw:***@127.0.0.1")
