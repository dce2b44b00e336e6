"""The package as a user installs it: the wheel built from this checkout, installed into a
fresh venv outside the repository, runs `qgw migrate` and `qgw serve` (embedded Redis, SQLite)
and carries a task to the mock upstream and back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app import ROOT
from tests.servers import free_port, stop, wait_port

ADMIN = "package-admin-token"


def _copy_source(dest: Path) -> None:
    """Copy what git would ship (tracked files, and new ones not ignored) and nothing local:
    a venv, a data dir or a link to another machine's path can never break the build."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_symlink() or not src.is_file():  # a link, or a file deleted but not committed
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)


def _run(*cmd: str | Path, timeout: float = 300, **kw: object) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stderr[-2000:]}"
    return str(done.stdout)


def _installed(tmp: Path) -> Path:
    """Build the wheel from a copy of the checkout (so no build/ is left in it) and install
    it into a new venv; the venv's bin directory. Installed by this interpreter's pip
    (`--python`) without byte-compiling: the venv's own pip and the bytecode of every
    dependency took 27 s of the 35 s of CPU the venv and its install did, and neither is
    what the test is about."""
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    _copy_source(src)
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src)
    (wheel,) = dist.glob("queue_gateway-*.whl")
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
         "--disable-pip-version-check", "--no-compile", wheel)
    return venv / "bin"


def test_the_wheel_installed_elsewhere_migrates_serves_and_runs_a_task(
    tmp_path: Path, fresh_upstream: str
) -> None:
    bin_dir = _installed(tmp_path)
    work = tmp_path / "run"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QGW_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(QGW_DATA_DIR=str(work / "data"), QGW_ADMIN_TOKEN=ADMIN)

    # The code runs from the venv, not from this checkout, and needs no httpx.
    where = _run(bin_dir / "python", "-c",
                 "import app, importlib.util as u; print(app.__file__, u.find_spec('httpx'))",
                 cwd=work, env=env)
    assert where.startswith(str(tmp_path / "venv")) and where.split()[1] == "None", where
    assert "database at head" in _run(bin_dir / "qgw", "migrate", cwd=work, env=env, timeout=60)

    port, log = free_port(), work / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen([bin_dir / "qgw", "serve", "--port", str(port)], cwd=work,
                                  env=env, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_port(port, 30, server)
        base, admin = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {ADMIN}"}
        target = f"{fresh_upstream}/packaged"
        r = httpx.post(f"{base}/admin/v1/endpoints", headers=admin,
                       json={"id": "packaged", "target_url": target})
        assert r.status_code == 201, r.text
        key = httpx.post(f"{base}/admin/v1/api-keys", headers=admin,
                         json={"user_id": 1}).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        task = httpx.post(f"{base}/api/v1/tasks", headers=auth,
                          json={"target_url": target, "body": "from the wheel"}).json()
        deadline = time.monotonic() + 20
        while True:
            status = httpx.get(f"{base}/api/v1/tasks/{task['task_id']}?wait=5", headers=auth,
                               timeout=10).json()
            if status["task_status"] not in ("pending", "processing"):
                break
            assert time.monotonic() < deadline, status
        assert status["task_status"] == "completed", status
        assert status["result_status_code"] == 200
    finally:
        stop(server)
    assert "Traceback" not in log.read_text(), log.read_text()[-2000:]
