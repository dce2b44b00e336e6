"""Start-up: each refusal is one line naming the cause and the fix (exit code != 0), and
`qgw serve` waits for a Redis that is not up yet, like `qgw dispatcher`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import QGW, RedisServer, free_port, read_until, stop, wait_port


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QGW, "serve", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("command", [["serve"], ["keys", "create", "--user-id", "3"]])
def test_an_embedded_redis_that_cannot_start_is_one_line(
    env: dict[str, str], tmp_path: Path, command: list[str]
) -> None:
    """A data dir too deep for a unix socket: one line naming the fix, from serve and admin."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {k: v for k, v in env.items() if k not in ("QGW_REDIS_URL", "QGW_DATABASE_URL")}
    env["QGW_DATA_DIR"] = str(deep)
    subprocess.run([*QGW, "migrate"], env=env, capture_output=True, timeout=60, check=True)
    done = subprocess.run([*QGW, *command], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("qgw: the data dir") and "QGW_DATA_DIR" in last, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("name", "value"), [("QGW_LOG_LEVEL", "verbose"),
                                             ("QGW_ADMIN_TOKEN", "abc"),
                                             ("QGW_SECRETS_KEY", "0123456789abcdef"),
                                             ("QGW_SECRETS_KEY_PREVIOUS", "z" * 64)])
def test_bad_setting_is_one_line(env: dict[str, str], name: str, value: str) -> None:
    r = _serve({**env, name: value})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and name in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["serve", "mock-upstream"])
def test_port_in_use_is_one_line_before_anything_starts(env: dict[str, str],
                                                        command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([*QGW, command, "--port", str(port)], env=env, capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""  # no "listening on" first
    assert r.stderr.count("\n") == 1 and "in use" in r.stderr and "--port" in r.stderr


def test_serve_waits_for_redis_with_one_line_warnings(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "late-redis")
    port = free_port()
    proc = subprocess.Popen([*QGW, "serve", "--port", str(port)],
                            env={**env, "QGW_REDIS_URL": redis.url}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = read_until(proc, "cannot reach Redis")
        assert proc.poll() is None  # still waiting, not dead
        redis.start()
        wait_port(port, timeout=20, proc=proc)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
    finally:
        stop(proc)
        redis.stop()
    assert proc.returncode in (0, -15)
    assert proc.stderr is not None
    # One JSON object a line: nothing printed around the logs (no traceback, no uvicorn lines).
    lines = [json.loads(line) for line in [*said, *proc.stderr.read().splitlines()]
             if line.strip()]
    waits = [rec for rec in lines if "cannot reach Redis" in rec["msg"]]
    assert waits and all(rec["level"] == "warning" and "exc" not in rec for rec in waits)
    assert not any("Traceback" in str(rec) for rec in lines)


def test_commands_that_serve_no_http_import_no_web_framework() -> None:
    """The command line (`qgw mock-upstream`, `qgw healthcheck`, the admin commands) and the
    dispatcher's runtime leave FastAPI alone: importing it was 0.4 s of CPU at every start of
    a container's healthcheck, an admin command, or a test's mock upstream."""
    code = "import sys, app.cli, app.runtime; print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_mock_upstream_and_the_healthcheck_start_with_their_own_modules_only() -> None:
    """`qgw mock-upstream` loads no settings, SQL or Redis client (0.8 s of CPU a start was
    0.2 without them; the suite starts a hundred), `qgw healthcheck` no admin commands. Each
    is run to its end: the mock refused its address (exit 1), the check its URL."""
    code = ("import sys\nfrom app import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    print(exc.code)\n"
            "print(sorted(m for m in ('sqlalchemy', 'redis', 'app.settings', 'app.admin_cli', "
            "'app.endpoints', 'fastapi') if m in sys.modules))")
    said = {args[0]: subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                                    text=True, timeout=60).stdout.split("\n")[:2]
            for args in (["mock-upstream", "--host", "256.0.0.1"],
                         ["healthcheck", "--url", f"http://127.0.0.1:{free_port()}/healthz"])}
    assert said == {"mock-upstream": ["1", "[]"],
                    "healthcheck": ["1", "['app.settings', 'redis']"]}, said
