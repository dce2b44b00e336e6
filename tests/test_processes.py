"""Real `qgw` processes: two dispatchers sharing one Redis, and `qgw serve` on embedded defaults."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from app.embedded import server_binary
from tests.conftest import Gateway
from tests.servers import QGW, free_port, stop, wait_port


async def test_two_dispatcher_processes_never_run_a_task_twice(
    gateway: Gateway,
    fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    await gateway.add_endpoint("pair", f"{fresh_upstream}/pair", max_concurrency=8)
    auth = await gateway.new_key()
    ids = [
        (
            await gateway.submit(
                auth, f"{fresh_upstream}/pair", body=str(i), headers={"X-Mock-Latency-Ms": ["5"]}
            )
        )["task_id"]
        for i in range(300)
    ]
    dispatcher_process()
    dispatcher_process()
    done = await gateway.wait_finished(auth, ids, timeout=60)
    assert {d["task_status"] for d in done} == {"completed"}
    log = httpx.get(f"{fresh_upstream}/_mock/log").json()
    calls = Counter(e["idempotency_key"] for e in log)
    assert set(calls) == set(ids) and max(calls.values()) == 1


def test_bad_setting_stops_start_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "QGW_PORT": "eighty", "QGW_DATA_DIR": str(tmp_path)}
    r = subprocess.run([*QGW, "serve"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "QGW_PORT" in r.stderr


async def test_serve_on_embedded_defaults_runs_a_task(tmp_path: Path, fresh_upstream: str) -> None:
    """The README walk-through: fresh data dir, embedded Redis and SQLite, one task done."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}
    proc = subprocess.Popen(
        [*QGW, "serve", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        await asyncio.to_thread(wait_port, port, 30, proc)
        token = (tmp_path / ".qgw" / "admin_token").read_text().strip()
        assert proc.stdout is not None
        banner = proc.stdout.readline() + proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in banner and token in banner
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            admin = {"Authorization": f"Bearer {token}"}
            r = await http.post(
                "/admin/v1/endpoints",
                headers=admin,
                json={"id": "demo", "target_url": f"{fresh_upstream}/demo"},
            )
            assert r.status_code == 201, r.text
            key = (
                await http.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})
            ).json()["key"]
            auth = {"Authorization": f"Bearer {key}"}
            task = (
                await http.post(
                    "/api/v1/tasks",
                    headers=auth,
                    json={"target_url": f"{fresh_upstream}/demo", "body": "hi"},
                )
            ).json()
            s = (await http.get(f"/api/v1/tasks/{task['task_id']}?wait=10", headers=auth)).json()
            for _ in range(50):
                if s["task_status"] == "completed":
                    break
                await asyncio.sleep(0.1)
                s = (await http.get(f"/api/v1/tasks/{task['task_id']}", headers=auth)).json()
            assert s["task_status"] == "completed" and s["result_status_code"] == 200
            assert (await http.get("/readyz")).json()["status"] == "ok"
    finally:
        stop(proc)
    assert proc.returncode in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert not (tmp_path / ".qgw" / "redis.sock").exists()  # the private server stopped too


def _servers_on(data_dir: Path) -> list[int]:
    """Pids of the Redis servers working in `data_dir` (the server changes into its --dir and
    rewrites its command line, so it is found by its working directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and "server" in os.readlink(entry / "exe")
                    and os.readlink(entry / "cwd") == str(data_dir.resolve())):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


async def _until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_embedded_redis_ends_with_its_serve_even_after_kill_9(tmp_path: Path) -> None:
    """kill -9 of `qgw serve` used to leave its valkey-server running, and the next start
    adopted it for good. Now the server dies with its process, and one a dead process left
    (an older version, say) is stopped and replaced at the next start."""
    sock = tmp_path / ".qgw" / "redis.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}

    def serve() -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        proc = subprocess.Popen([*QGW, "serve", "--port", str(port)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return proc, port

    try:
        await _kill_9_then_orphan(serve, sock)
    finally:  # a failure leaves no server behind
        for pid in _servers_on(sock.parent):
            os.kill(pid, signal.SIGKILL)


async def _kill_9_then_orphan(
    serve: Callable[[], tuple[subprocess.Popen[bytes], int]], sock: Path
) -> None:
    first, port = serve()
    try:
        await asyncio.to_thread(wait_port, port, 30, first)
        assert len(_servers_on(sock.parent)) == 1
        first.kill()
        first.wait()
        assert await _until(lambda: not _servers_on(sock.parent), 5), "the server outlived kill -9"
    finally:
        stop(first)

    # What an older version left behind: a server on the data dir whose owner is gone.
    orphan = subprocess.Popen(
        [server_binary(), "--port", "0", "--unixsocket", str(sock), "--save", "",
         "--dir", str(sock.parent), "--appendonly", "yes"], stdout=subprocess.DEVNULL)
    assert await _until(sock.exists, 10)
    second, port = serve()
    try:
        await asyncio.to_thread(wait_port, port, 30, second)
        assert await asyncio.to_thread(orphan.wait, 10) == 0  # shut down, not adopted
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/readyz")).json()["status"] == "ok"
        assert len(_servers_on(sock.parent)) == 1
    finally:
        stop(second)
        stop(orphan)
    assert await _until(lambda: not _servers_on(sock.parent), 5), "the server outlived its serve"
