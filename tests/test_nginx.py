"""End to end through real nginx (auth_request) in front of the mock upstream, with `qgw serve`
as the gateway: only a live permit reaches the business API. Uses deploy/nginx/nginx.conf as
shipped."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import ROOT
from tests.conftest import ADMIN
from tests.servers import QGW, free_port, stop, wait_port

# `make test` installs nginx-light (scripts/system-deps): missing, these tests fail, not skip.
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


@pytest.fixture
def stack(tmp_path: Path, env: dict[str, str], fresh_upstream: str) -> Iterator[dict[str, Any]]:
    gw_port, ng_port = free_port(), free_port()
    gateway = subprocess.Popen([*QGW, "serve", "--port", str(gw_port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    upstream_hostport = fresh_upstream.removeprefix("http://")
    snippet = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    snippet = snippet.replace("GATEWAY", f"127.0.0.1:{gw_port}").replace("UPSTREAM",
                                                                         upstream_hostport)
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"daemon off;\nerror_log {tmp_path}/error.log;\npid {tmp_path}/nginx.pid;\n"
        "events {}\nhttp {\n"
        f"  access_log off;\n  client_body_temp_path {tmp_path};\n"
        f"  proxy_temp_path {tmp_path};\n"
        f"  server {{\n    listen 127.0.0.1:{ng_port};\n{snippet}\n  }}\n}}\n")
    nginx = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(gw_port, 30, gateway)
        wait_port(ng_port, 10, nginx)
        yield {"gateway": f"http://127.0.0.1:{gw_port}", "nginx": f"http://127.0.0.1:{ng_port}",
               "upstream": fresh_upstream}
    finally:
        stop(nginx)
        stop(gateway)


async def test_only_a_live_permit_reaches_the_upstream(stack: dict[str, Any]) -> None:
    target = f"{stack['upstream']}/api/generate"
    async with httpx.AsyncClient(base_url=stack["gateway"]) as gw, httpx.AsyncClient(
        base_url=stack["nginx"]
    ) as front:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.post("/admin/v1/endpoints", headers=admin, json={
            "id": "gen", "target_url": target, "permit_max_uses": 2, "permit_ttl_s": 2})
        assert r.status_code == 201, r.text
        key = (await gw.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})).json()
        auth = {"Authorization": f"Bearer {key['key']}"}

        async def admitted() -> dict[str, str]:
            task = (await gw.post("/api/v1/tasks", headers=auth, json={
                "target_url": target, "task_type": "online"})).json()
            for _ in range(100):
                s = (await gw.get(f"/api/v1/tasks/{task['task_id']}", headers=auth)).json()
                if s["permit"]:
                    return {"X-Queue-Task-Id": s["task_id"],
                            "X-Queue-Permit": s["permit"]["token"]}
                await asyncio.sleep(0.05)
            raise AssertionError("not admitted")

        assert (await front.post("/api/generate")).status_code == 401
        permit = await admitted()
        assert (await front.post("/api/generate", headers=permit, content="1")).status_code == 200
        assert (await front.post("/api/generate", headers=permit, content="2")).status_code == 200
        assert (await front.post("/api/generate", headers=permit)).status_code == 403  # 2 uses

        cancelled = await admitted()
        await gw.post(f"/api/v1/tasks/{cancelled['X-Queue-Task-Id']}/cancel", headers=auth)
        assert (await front.post("/api/generate", headers=cancelled)).status_code == 403

        expiring = await admitted()
        await asyncio.sleep(2.2)
        assert (await front.post("/api/generate", headers=expiring)).status_code == 403

        log = httpx.get(f"{stack['upstream']}/_mock/log").json()
        assert [e["body"] for e in log] == ["1", "2"]  # nothing refused got through
        assert all("x-queue-permit" not in e["headers"] for e in log)


async def test_the_checked_path_is_the_one_nginx_passes_on(stack: dict[str, Any]) -> None:
    """A path the upstream sees as another (`//api/api/generate`) is checked as it is, and a
    client's own X-Original-* / X-Forwarded-* change nothing."""
    target = f"{stack['upstream']}/api/generate"
    async with httpx.AsyncClient(base_url=stack["gateway"]) as gw, httpx.AsyncClient() as front:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.post("/admin/v1/endpoints", headers=admin, json={
            "id": "gen", "target_url": target, "permit_max_uses": 5})
        assert r.status_code == 201, r.text
        key = (await gw.post("/admin/v1/api-keys", headers=admin, json={"user_id": 1})).json()
        auth = {"Authorization": f"Bearer {key['key']}"}
        task = (await gw.post("/api/v1/tasks", headers=auth, json={
            "target_url": target, "task_type": "online"})).json()
        for _ in range(100):
            s = (await gw.get(f"/api/v1/tasks/{task['task_id']}", headers=auth)).json()
            if s["permit"]:
                break
            await asyncio.sleep(0.05)
        permit = {"X-Queue-Task-Id": s["task_id"], "X-Queue-Permit": s["permit"]["token"]}
        smuggled = {**permit, "X-Original-URI": "/api/generate", "X-Original-Method": "POST",
                    "X-Forwarded-Uri": "/api/generate", "X-Forwarded-Method": "POST"}
        base = httpx.URL(stack["nginx"])

        async def call(method: str, raw_path: str) -> int:
            url = base.copy_with(raw_path=raw_path.encode())
            r = await front.request(method, url, headers=smuggled, content=raw_path)
            return r.status_code

        for method, path in (("DELETE", "/api/admin/delete_all"), ("POST", "/api/other"),
                             ("DELETE", "/api/generate"), ("POST", "//api/api/generate"),
                             ("POST", "//api%2fgenerate/api/generate")):
            assert await call(method, path) == 403, (method, path)
        assert await call("POST", "/api/generate?size=1") == 200
        log = httpx.get(f"{stack['upstream']}/_mock/log").json()
        assert [(e["method"], e["body"]) for e in log] == [("POST", "/api/generate?size=1")]
