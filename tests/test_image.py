"""The image and the compose stack, without a Docker engine (the build machines have none):
every command the image runs (Dockerfile CMD and HEALTHCHECK, the command and health check of
each compose service built from it) runs here, read from those files, wired as compose wires
them: migrate once, API and dispatcher with QGW_AUTO_MIGRATE=false against MariaDB, the mock
upstream, their health checks, and a task through all of them. Also the production shape of
both files. `make lint` checks them with hadolint and against the compose spec."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from app import ROOT
from tests.conftest import ADMIN
from tests.servers import (
    QGW,
    MariaDB,
    RedisServer,
    carry_one_task,
    free_port,
    stop,
    wait_port,
)

DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
BUILT = {name: s for name, s in COMPOSE["services"].items() if "build" in s}
ONE_SHOT = {"migrate"}


def _instruction(name: str) -> str:
    """One instruction of the image's final stage, continuation lines joined."""
    final = DOCKERFILE.replace("\\\n", " ").rpartition("\nFROM ")[2]
    line: str
    (line,) = re.findall(rf"^{name} .*$", final, re.MULTILINE)
    return line


def _exec_form(instruction: str) -> list[str]:
    argv: list[str] = json.loads(_instruction(instruction).split("CMD", 1)[1])
    return argv


IMAGE_CMD = _exec_form("CMD")
IMAGE_HEALTHCHECK = _exec_form("HEALTHCHECK")


def _healthcheck(service: dict[str, Any]) -> list[str]:
    """The check Docker runs for a service: its own, or the image's."""
    test: list[str] = service.get("healthcheck", {}).get("test", ["CMD", *IMAGE_HEALTHCHECK])
    assert test[0] == "CMD", test
    return test[1:]


def _qgw(argv: list[str]) -> list[str]:
    """`qgw ...` as the image runs it (on PATH from /venv), here from the test venv."""
    assert argv[0] == "qgw", argv
    return [*QGW, *argv[1:]]


def _image_env() -> dict[str, str]:
    """This environment less QGW_*, plus the QGW_* the image sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}
    env.update(re.findall(r"(QGW_\w+)=(\S+)", _instruction("ENV")))
    return env


def _loopback(argv: list[str], ports: dict[str, int]) -> list[str]:
    """Listen on loopback, on free ports, instead of 0.0.0.0 and the fixed ports of compose."""
    text = json.dumps(argv).replace("0.0.0.0", "127.0.0.1")
    for fixed, free in ports.items():
        text = re.sub(rf"\b{fixed}\b", str(free), text)
    out: list[str] = json.loads(text)
    return out


def test_compose_builds_only_services_this_test_runs() -> None:
    assert set(BUILT) == {"migrate", "api", "dispatcher", "mock-upstream"}, (
        "a new service built from the Dockerfile: run its commands in this test too")


def test_dockerfile_and_compose_are_production_shaped() -> None:
    # Dependencies in a layer before the code; the code copied once, as the installed wheel.
    deps, code = DOCKERFILE.index("-r requirements/run.txt"), DOCKERFILE.index("COPY app ")
    assert deps < code and DOCKERFILE.count("COPY app ") == 1 and "PYTHONPATH" not in DOCKERFILE
    assert re.search(r"^USER 10001(:10001)?$", DOCKERFILE, re.MULTILINE)
    for name, service in COMPOSE["services"].items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure", "no"), name
        if name not in ONE_SHOT:
            assert not service.get("healthcheck", {}).get("disable"), name
            if "build" not in service:
                assert service.get("healthcheck", {}).get("test"), name
    # Secrets come from the operator's environment, never from the file.
    db_url = BUILT["api"]["environment"]["QGW_DATABASE_URL"]
    password = COMPOSE["services"]["mariadb"]["environment"]["MARIADB_PASSWORD"]
    assert password.startswith("${QGW_DB_PASSWORD:?") and ":${QGW_DB_PASSWORD:?" in db_url
    assert BUILT["migrate"]["environment"]["QGW_DATABASE_URL"] == db_url
    for var in ("QGW_ADMIN_TOKEN", "QGW_PERMIT_SECRET", "QGW_SECRETS_KEY"):
        assert BUILT["api"]["environment"][var].startswith(f"${{{var}:?")


class Stack:
    """The services built from the image, as processes on loopback."""

    def __init__(self, tmp: Path, db_url: str, redis_url: str) -> None:
        self.tmp, self.db_url, self.redis_url = tmp, db_url, redis_url
        self.ports = {"8080": free_port(), "9000": free_port()}
        self.prefix = f"img{uuid.uuid4().hex[:10]}"  # the session's Redis is shared
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, name: str) -> dict[str, str]:
        """The image's ENV and the service's environment, with our servers and secrets."""
        env = _image_env()
        env.update({k: str(v) for k, v in BUILT[name].get("environment", {}).items()})
        data = self.tmp / name
        data.mkdir(exist_ok=True)
        env.update(QGW_DATA_DIR=str(data), QGW_HOST="127.0.0.1", QGW_KEY_PREFIX=self.prefix,
                   QGW_PORT=str(self.ports[env["QGW_PORT"]]), QGW_DATABASE_URL=self.db_url)
        if "QGW_REDIS_URL" in env:
            env["QGW_REDIS_URL"] = self.redis_url
        if "QGW_ADMIN_TOKEN" in env:
            env.update(QGW_ADMIN_TOKEN=ADMIN, QGW_PERMIT_SECRET="image-permit-secret",
                       QGW_SECRETS_KEY="ab" * 32)
        return env

    def argv(self, argv: list[str]) -> list[str]:
        return _qgw(_loopback(argv, self.ports))

    def run(self, name: str) -> None:
        done = subprocess.run(self.argv(BUILT[name]["command"]), env=self.env(name),
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]

    def start(self, name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.argv(BUILT[name]["command"]), env=self.env(name),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def healthy(self, name: str) -> tuple[bool, str]:
        done = subprocess.run(self.argv(_healthcheck(BUILT[name])), env=self.env(name),
                              capture_output=True, timeout=30)
        return done.returncode == 0, done.stderr.decode().strip()

    def wait_healthy(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (result := self.healthy(name))[0]:
            assert time.monotonic() < deadline, f"{name}: {result[1]}"
            time.sleep(0.3)


@contextmanager
def stack(tmp: Path, db_url: str, redis_url: str) -> Iterator[Stack]:
    s = Stack(tmp, db_url, redis_url)
    try:
        yield s
    finally:
        for proc in s.procs:
            stop(proc)


def test_every_command_of_the_compose_stack_runs_and_carries_a_task(
    tmp_path: Path, mariadb: MariaDB, redis_server: RedisServer
) -> None:
    db_url = mariadb.create_database(f"image{uuid.uuid4().hex[:8]}")
    with stack(tmp_path, db_url, redis_server.url) as s:
        s.run("migrate")
        api, dispatcher = s.start("api"), s.start("dispatcher")
        s.start("mock-upstream")
        for name in ("api", "dispatcher", "mock-upstream"):
            s.wait_healthy(name)
        base = f"http://127.0.0.1:{s.ports['8080']}"
        target = f"http://127.0.0.1:{s.ports['9000']}/api/generate_image"
        status = carry_one_task(base, ADMIN, "gen-image", target)
        assert status["task_status"] == "completed", status

        # A hung dispatcher (stopped, so it cannot touch its heartbeat) turns unhealthy.
        check = s.argv([*_healthcheck(BUILT["dispatcher"]), "--max-age", "1.5"])
        dispatcher.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.5)
            done = subprocess.run(check, env=s.env("dispatcher"), capture_output=True,
                                  timeout=30)
            assert done.returncode == 1 and b"last heartbeat" in done.stderr, done.stderr
        finally:
            dispatcher.send_signal(signal.SIGCONT)
        s.wait_healthy("dispatcher")
        stop(dispatcher)
        assert dispatcher.returncode == 0  # SIGTERM is a graceful stop
        stop(api)
        ok, why = s.healthy("api")
        assert not ok and "healthz" in why


def test_the_image_default_command_serves_and_is_healthy(tmp_path: Path) -> None:
    """`docker run` of the image alone: `qgw serve` (embedded Redis and SQLite in /data)."""
    port = free_port()
    env = {**_image_env(), "QGW_HOST": "127.0.0.1", "QGW_PORT": str(port),
           "QGW_DATA_DIR": str(tmp_path)}
    proc = subprocess.Popen(_qgw(IMAGE_CMD), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 30, proc)
        done = subprocess.run(_qgw(IMAGE_HEALTHCHECK), env=env, capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
    finally:
        stop(proc)
