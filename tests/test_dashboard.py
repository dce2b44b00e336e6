"""GET /dashboard in headless Chromium against a real `qgw serve`: the page loads, shows an
endpoint, and its numbers move while tasks are submitted. Saves a screenshot to .artifacts/."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from app import ROOT
from tests.conftest import ADMIN, Gateway
from tests.servers import QGW, free_port, stop, wait_port

CHROMIUM = os.environ.get("QGW_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / ".artifacts"
NO_VALUE = "\u2013"  # what the page shows for a number it does not have (an en dash)
pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
    reason="chromium not installed (CI installs Debian's chromium)",
)


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """`qgw serve` (API + dispatcher) on this test's Redis, key prefix and database."""
    port = free_port()
    proc = subprocess.Popen([*QGW, "serve", "--port", str(port)], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 30, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


async def test_dashboard_shows_queues_moving(
    gateway: Gateway, served: str, upstream: str, browser: object
) -> None:
    from playwright.async_api import Browser, expect

    assert isinstance(browser, Browser)
    url = f"{upstream}/dash"
    await gateway.add_endpoint("dash", url, max_concurrency=2, rate=50, avg_exec_ms=200)
    auth = await gateway.new_key()
    page = await browser.new_page(viewport={"width": 1400, "height": 600})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # No token: the page asks for one and shows no data.
    await page.goto(f"{served}/dashboard")
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#queues")).to_be_hidden()

    # With the token in the fragment (never sent to the server), it shows the endpoint.
    await page.goto(f"{served}/dashboard#token={ADMIN}")
    row = page.locator('tr[data-endpoint="dash"]')
    await expect(row).to_be_visible(timeout=10_000)
    assert ADMIN not in page.url  # taken out of the address bar
    pending, done = row.locator('td[data-field="pending"]'), row.locator(
        'td[data-field="done_failed"]')
    await expect(pending).to_have_text("0")
    await expect(done).to_have_text("0 / 0")

    async with httpx.AsyncClient(base_url=served) as http:
        for i in range(24):
            r = await http.post("/api/v1/tasks", headers=auth, json={
                "target_url": url, "body": str(i), "headers": {"X-Mock-Latency-Ms": ["250"]}})
            assert r.status_code == 202, r.text
        fail = await http.post("/api/v1/tasks", headers=auth, json={
            "target_url": url, "headers": {"X-Mock-Status": ["422"]}})
        assert fail.status_code == 202

    # Two slots of 250 ms for 25 tasks: the line is visible for about three seconds.
    await expect(pending).not_to_have_text("0", timeout=10_000)
    await expect(row.locator('td[data-field="in_flight"]')).to_contain_text("/ 2")
    await expect(row.locator('td[data-field="wait_new"]')).not_to_have_text(NO_VALUE)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    await expect(done).to_have_text("24 / 1", timeout=20_000)
    await expect(pending).to_have_text("0")
    await expect(page.locator("#failures")).to_contain_text(fail.json()["task_id"])
    await expect(row.locator('td[data-field="throughput"]')).not_to_have_text("0")
    # The chart has drawn points for depth and throughput.
    points = await row.locator("svg.chart polyline.depth").get_attribute("points")
    assert points and len(points.split()) >= 3
    await page.screenshot(path=str(ARTIFACTS / "dashboard-after.png"), full_page=True)
    print(f"\ndashboard screenshots: {shot} and {ARTIFACTS / 'dashboard-after.png'}")
    assert errors == []

    # A wrong token is dropped and the form comes back.
    await page.goto(f"{served}/dashboard#token=wrong")
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#status")).to_contain_text("not accepted")
