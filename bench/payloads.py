"""Binary answers through the gateway (issue "Results as the upstream sent them").

1. 1 MB binary answers, 16 in flight: tasks/s and the gateway's CPU per MB, this tree against
   the tree before bytes were kept (the text path: every body decoded with errors="replace"),
   in the same run, same Redis, same mock upstream. Give the old tree's path as
   `--base /path/to/checkout` (a `git worktree add` of the commit before).
2. A 1 GiB answer through an S3 result store (SeaweedFS): the call's time against a direct
   download of the same bytes from the mock, and the peak RSS growth of the dispatcher (while
   the answer goes in) and of the API process (while `/result` streams it out), as a fraction
   of the answer's size.

Loopback only, bounded (N tasks, one large answer), every process stopped at the end.
    PYTHONPATH=. python bench/payloads.py --base ../results-base
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import QGW, RedisServer, SeaweedFS, free_port, stop, wait_port  # noqa: E402

ADMIN = "bench-admin-token-0123456789"
TASKS, SIZE, IN_FLIGHT = 160, 1_000_000, 16
HUGE = 1 << 30


def gateway(tree: Path, role: str, env: dict[str, str], port: int | None = None
            ) -> subprocess.Popen[bytes]:
    args = [*QGW, role, *(["--port", str(port)] if port else [])]
    return subprocess.Popen(args, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def base_env(redis: str, data: Path, **extra: str) -> dict[str, str]:
    data.mkdir(parents=True, exist_ok=True)
    return {"QGW_REDIS_URL": redis, "QGW_DATA_DIR": str(data), "QGW_ADMIN_TOKEN": ADMIN,
            "QGW_KEY_PREFIX": f"b{uuid.uuid4().hex[:8]}", "QGW_LOG_LEVEL": "warning", **extra}


async def setup(http: httpx.AsyncClient, upstream: str, name: str, cap: int) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await http.post("/admin/v1/endpoints", headers=admin, json={
        "id": name, "target_url": f"{upstream}/{name}", "max_concurrency": cap,
        "timeout_ms": 600_000, "max_retries": 0, "forward_headers": ["X-Mock-Binary"]})
    r.raise_for_status()
    r = await http.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def finished(http: httpx.AsyncClient, auth: dict[str, str], tid: str) -> dict[str, Any]:
    for _ in range(3000):
        r = await http.get(f"/api/v1/tasks/{tid}", headers=auth, params={"wait": 10})
        body: dict[str, Any] = r.json()
        if r.status_code == 200 and body["task_status"] not in ("pending", "processing"):
            return body
        await asyncio.sleep(0.01 if r.status_code == 200 else 0.5)
    raise RuntimeError(f"{tid} did not finish: {r.status_code} {r.text[:300]}")


async def one_megabyte_run(tree: Path, redis: str, upstream: str, work: Path) -> dict[str, float]:
    """TASKS answers of SIZE bytes, IN_FLIGHT at a time, through `qgw serve` of `tree`."""
    port = free_port()
    proc = gateway(tree, "serve", base_env(redis, work / tree.name), port)
    try:
        await asyncio.to_thread(wait_port, port, 60.0, proc)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            auth = await setup(http, upstream, "mb", IN_FLIGHT)
            ps = psutil.Process(proc.pid)
            cpu0, t0 = sum(ps.cpu_times()[:2]), time.monotonic()
            ids = []
            for i in range(TASKS):
                r = await http.post("/api/v1/tasks", headers=auth, json={
                    "target_url": f"{upstream}/mb",
                    "headers": {"X-Mock-Binary": [f"{SIZE};seed={i}"]}})
                ids.append(r.json()["task_id"])
            done = await asyncio.gather(*(finished(http, auth, t) for t in ids))
            spent, cpu = time.monotonic() - t0, sum(ps.cpu_times()[:2]) - cpu0
            ok = sum(d["task_status"] == "completed" for d in done)
            exact = sum(await asyncio.gather(*(_exact(http, auth, d, i)
                                               for i, d in enumerate(done))))
    finally:
        stop(proc)
    mb = TASKS * SIZE / 1e6
    return {"tasks_s": TASKS / spent, "cpu_ms_per_mb": cpu / mb * 1000, "completed": ok,
            "byte_exact": exact}


async def _exact(http: httpx.AsyncClient, auth: dict[str, str], done: dict[str, Any],
                 seed: int) -> int:
    """1 when the answer came back as sent (through /result where the tree has it)."""
    from app.mock_upstream import binary_body

    want = b"".join(binary_body(SIZE, seed))
    r = await http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
    if r.status_code == 200:
        return int(r.content == want)
    return int((done.get("task_result") or "").encode("latin-1", "replace") == want)


async def _peak(proc: psutil.Process, stop_: asyncio.Event) -> int:
    peak = 0
    while not stop_.is_set():
        peak = max(peak, proc.memory_info().rss)
        await asyncio.sleep(0.02)
    return peak


async def huge_run(redis: str, upstream: str, work: Path) -> dict[str, float]:
    """One 1 GiB answer through an S3 store, split `qgw api` and `qgw dispatcher`."""
    s3 = SeaweedFS(work / "s3")
    await asyncio.to_thread(s3.start)
    port = free_port()
    env = base_env(redis, work / "huge", QGW_RESULT_STORE=f"s3://{SeaweedFS.BUCKET}/bench",
                   QGW_MAX_RESULT_BYTES=str(2 << 30), **s3.env())
    api, disp = gateway(ROOT, "api", env, port), gateway(ROOT, "dispatcher", env)
    try:
        await asyncio.to_thread(wait_port, port, 60.0, api)
        direct = await _download(f"{upstream}/direct", {"X-Mock-Binary": f"{HUGE};seed=1"})
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            auth = await setup(http, upstream, "huge", 1)
            await asyncio.sleep(2)
            d, a = psutil.Process(disp.pid), psutil.Process(api.pid)
            d0, a0 = d.memory_info().rss, a.memory_info().rss
            stop_ = asyncio.Event()
            peak = asyncio.create_task(_peak(d, stop_))
            t0 = time.monotonic()
            r = await http.post("/api/v1/tasks", headers=auth, json={
                "target_url": f"{upstream}/huge",
                "headers": {"X-Mock-Binary": [f"{HUGE};seed=1"]}})
            done = await finished(http, auth, r.json()["task_id"])
            call_s = time.monotonic() - t0
            stop_.set()
            d_peak = await peak
            assert done["task_status"] == "completed", done
            stop_ = asyncio.Event()
            peak = asyncio.create_task(_peak(a, stop_))
            t0 = time.monotonic()
            digest = await _download(f"http://127.0.0.1:{port}/api/v1/tasks/"
                                     f"{done['task_id']}/result", auth)
            read_s = time.monotonic() - t0
            stop_.set()
            a_peak = await peak
    finally:
        for p in (api, disp):
            stop(p)
        s3.stop()
    return {"direct_s": direct[1], "call_s": call_s, "read_s": read_s,
            "same_bytes": float(digest[0] == direct[0]),
            "dispatcher_growth": (d_peak - d0) / HUGE, "api_growth": (a_peak - a0) / HUGE}


async def _download(url: str, headers: dict[str, str]) -> tuple[bytes, float]:
    h, t0 = hashlib.sha256(), time.monotonic()
    async with httpx.AsyncClient(timeout=600) as http, http.stream("GET", url,
                                                                     headers=headers) as r:
        async for chunk in r.aiter_raw(1 << 20):
            h.update(chunk)
    return h.digest(), time.monotonic() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True,
                        help="a checkout of the tree before bytes were kept")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        redis = RedisServer(work / "redis")
        redis.start()
        up_port = free_port()
        upstream = subprocess.Popen([*QGW, "mock-upstream", "--port", str(up_port)],
                                    cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        try:
            wait_port(up_port, proc=upstream)
            up = f"http://127.0.0.1:{up_port}"
            old = await one_megabyte_run(args.base.resolve(), redis.url, up, work)
            new = await one_megabyte_run(ROOT, redis.url, up, work)
            print(f"1 MB binary answers, {TASKS} tasks, {IN_FLIGHT} in flight (serve):")
            for name, r in (("before (text path)", old), ("bytes kept", new)):
                print(f"  {name:20} {r['tasks_s']:7.1f} tasks/s  {r['cpu_ms_per_mb']:6.1f} ms "
                      f"CPU/MB  completed {r['completed']:.0f}/{TASKS}  byte-exact "
                      f"{r['byte_exact']:.0f}/{TASKS}")
            print(f"  ratio bytes/text: tasks/s x{new['tasks_s'] / old['tasks_s']:.2f}, "
                  f"CPU per MB x{new['cpu_ms_per_mb'] / old['cpu_ms_per_mb']:.2f}")
            h = await huge_run(redis.url, up, work)
            print("1 GiB answer through S3 (SeaweedFS), api and dispatcher apart:")
            call, read = h["call_s"] / h["direct_s"], h["read_s"] / h["direct_s"]
            print(f"  call (upstream -> store) / direct download: x{call:.2f}"
                  f"  ({h['call_s']:.1f} s vs {h['direct_s']:.1f} s)")
            print(f"  /result (store -> caller) / direct download: x{read:.2f}"
                  f"  same bytes: {bool(h['same_bytes'])}")
            print(f"  peak RSS growth / answer size: dispatcher {h['dispatcher_growth']:.3f}, "
                  f"api {h['api_growth']:.3f} ({h['dispatcher_growth'] * HUGE / 2**20:.0f} MiB, "
                  f"{h['api_growth'] * HUGE / 2**20:.0f} MiB)")
        finally:
            stop(upstream)
            redis.stop()


if __name__ == "__main__":
    asyncio.run(main())
