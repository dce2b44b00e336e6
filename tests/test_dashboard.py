"""GET /dashboard in headless Chromium against a real `qgw serve`: the page loads, lists the
endpoints busiest first, its numbers and chart move while tasks are submitted, the filter narrows
the rows, and failures are told apart. Saves screenshots to .artifacts/."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from app import ROOT
from app.settings import Settings
from tests.conftest import ADMIN, Gateway
from tests.servers import QGW, TLS, RedisServer, free_port, mock_log, stop, wait_port

# `make test` installs chromium (scripts/system-deps): missing, these tests fail, not skip.
CHROMIUM = os.environ.get("QGW_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / ".artifacts"
NO_VALUE = "\u2013"  # what the page shows for a number it does not have (an en dash)


@contextmanager
def serving(env: dict[str, str], cwd: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`qgw serve` (API + dispatcher) on the Redis, key prefix and database of `env`."""
    port = free_port()
    proc = subprocess.Popen([*QGW, "serve", "--port", str(port)], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 30, proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    with serving(env, tmp_path) as (url, _):
        yield url


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
    # Sorts before "dash" by id and stays idle: busiest first must list "dash" above it.
    await gateway.add_endpoint("alpha-idle", f"{upstream}/alpha-idle")
    auth = await gateway.new_key()
    page = await browser.new_page(viewport={"width": 1400, "height": 820})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # No token: the page asks for one and shows no data.
    await page.goto(f"{served}/dashboard")
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#queues")).to_be_hidden()

    # With the token in the fragment (never sent to the server), it shows the endpoint.
    await page.goto(f"{served}/dashboard#token={ADMIN}")
    row = page.locator('tr[data-endpoint="dash"]')
    rows = page.locator("#rows tr")
    await expect(row).to_be_visible(timeout=10_000)
    assert ADMIN not in page.url  # taken out of the address bar
    pending, done = row.locator('td[data-field="pending"]'), row.locator(
        'td[data-field="done_failed"]')
    await expect(pending).to_have_text("0")
    await expect(done).to_have_text("0 / 0")
    await expect(rows).to_have_count(2)

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
    await expect(rows.first).to_have_attribute("data-endpoint", "dash")  # the busiest on top
    await expect(page.locator("#chart-title")).to_have_text("dash")  # and in the chart
    await expect(row.locator('td[data-field="in_flight"]')).to_contain_text("/ 2")
    await expect(row.locator('td[data-field="wait_new"]')).not_to_have_text(NO_VALUE)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    await expect(done).to_have_text("24 / 1", timeout=20_000)
    await expect(pending).to_have_text("0")
    await expect(page.locator("#failures")).to_contain_text(fail.json()["task_id"])
    await expect(row.locator('td[data-field="throughput"]')).not_to_have_text("0")
    await row.locator("svg.chart path.depth").wait_for()  # the row's depth trend is drawn
    await _assert_chart_shows_the_run(page)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-after.png"), full_page=True)
    print(f"\ndashboard screenshots: {shot} and {ARTIFACTS / 'dashboard-after.png'}")

    # The filter narrows the rows by endpoint id; a click charts that endpoint.
    await page.fill("#filter", "ALPHA")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_have_attribute("data-endpoint", "alpha-idle")
    await expect(page.locator("#shown")).to_have_text("1 of 2 endpoints")
    await page.fill("#filter", "no-such-endpoint")
    await expect(rows).to_have_count(0)
    await expect(page.locator("#empty")).to_contain_text("No endpoint id contains")
    await page.fill("#filter", "")
    await expect(rows).to_have_count(2)
    await page.locator('tr[data-endpoint="alpha-idle"]').click()
    await expect(page.locator("#chart-title")).to_have_text("alpha-idle")
    await expect(page.locator("#chart-mode")).to_have_text("(selected)")
    await page.locator("#follow").click()  # all idle now: the busiest is the first by id
    await expect(page.locator("#chart-mode")).to_have_text("(busiest)")
    await expect(page.locator("#chart-title")).to_have_text(
        await rows.first.get_attribute("data-endpoint") or "")
    assert errors == []


def _path_points(d: str | None) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d or "")]


async def _assert_chart_shows_the_run(page: object) -> None:
    """Both series are drawn with more than a flat line, and every axis is labelled."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    chart = page.locator("#chart")
    for series in ("depth", "tput"):
        points = _path_points(await chart.locator(f"path.{series}").get_attribute("d"))
        assert len(points) >= 3, (series, points)
        assert len({y for _, y in points}) > 1, (series, points)  # it rose and fell
        top = chart.locator(f"text.{series}.max")
        await expect(top).to_be_visible()
        assert float(await top.text_content() or 0) > 0, series
    # 25 tasks, two at a time: the depth axis reaches at least ten.
    assert float(await chart.locator("text.depth.max").text_content() or 0) >= 10
    times = await chart.locator("text.time").all_text_contents()
    assert times[0] == "now" and len(times) >= 2 and all(t.startswith("-") for t in times[1:])
    await expect(page.locator("#legend-depth")).to_have_text("0")


class TestFailures:
    """Against a Redis of their own, which the test stops and starts again."""

    @pytest.fixture
    def settings(self, settings: Settings, own_redis: RedisServer) -> Settings:
        """Overrides conftest's (on this Redis): `gateway` and `env` use it too."""
        return settings.model_copy(update={"redis_url": own_redis.url})

    async def test_each_failure_has_its_own_message(
        self, gateway: Gateway, env: dict[str, str], tmp_path: Path, own_redis: RedisServer,
        browser: object
    ) -> None:
        """A bad token is asked for again; an outage is named and retried."""
        from playwright.async_api import Browser, expect

        assert isinstance(browser, Browser)
        page = await browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        status, login = page.locator("#status"), page.locator("#login")
        with serving(env, tmp_path) as (served, proc):
            # A token a header cannot carry (the euro sign is not Latin-1): asked again at once.
            await page.goto(f"{served}/dashboard#token=%E2%82%AC")
            await expect(login).to_be_visible()
            await expect(status).to_contain_text("cannot send in a header")

            # A wrong token is dropped and the form comes back.
            await page.goto(f"{served}/dashboard#token=wrong")
            await expect(status).to_contain_text("token refused (HTTP 401)")
            await expect(login).to_be_visible()

            await page.goto(f"{served}/dashboard#token={ADMIN}")
            await expect(page.locator("#queues")).to_be_visible(timeout=10_000)
            own_redis.stop()
            await expect(status).to_have_text("gateway up, Redis unavailable: retrying",
                                              timeout=10_000)
            own_redis.start()  # same port: the page picks up again by itself
            await expect(status).to_contain_text("updated", timeout=10_000)
            stop(proc)
            await expect(status).to_have_text("cannot reach the gateway: retrying")
            await expect(page.locator("#queues")).to_be_visible()  # the last numbers stay
        assert errors == []


async def test_docs_render_without_internet(served: str, browser: object) -> None:
    """/docs in a browser that may reach nothing but the gateway: every operation is listed
    and the security schemes offer the Authorize dialog (a CDN asset would leave it blank)."""
    from playwright.async_api import Browser, Route, expect

    assert isinstance(browser, Browser)
    page = await browser.new_page()
    elsewhere: list[str] = []

    async def local_only(route: Route) -> None:
        if route.request.url.startswith(served):
            await route.continue_()
        else:
            elsewhere.append(route.request.url)
            await route.abort()

    await page.route("**/*", local_only)
    await page.goto(f"{served}/docs")
    submit = page.locator("#operations-tasks-submit_task")
    await expect(submit).to_be_visible(timeout=10_000)
    doc = httpx.get(f"{served}/openapi.json").json()
    await expect(page.locator(".opblock")).to_have_count(
        sum(len(ops) for ops in doc["paths"].values()))
    await expect(page.locator("button.authorize")).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "docs.png"))
    assert elsewhere == []


async def _admin(served: str, method: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=served, verify=TLS) as http:
        r = await http.request(method, path, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        return r.json()


async def test_operator_acts_from_the_dashboard(
    gateway: Gateway, served: str, fresh_upstream: str, browser: object
) -> None:
    """Pause, purge with a confirmation, retry from a task's drill-down, the dispatchers and
    the database shown, a reload that charts the history the server kept, an upstream's pause
    and a proxied request's task (no retry offered)."""
    from playwright.async_api import Browser, Dialog, expect

    assert isinstance(browser, Browser)
    url = f"{fresh_upstream}/act"
    await gateway.add_endpoint("act", url)
    auth = await gateway.new_key(user_id=5)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"{served}/dashboard#token={ADMIN}")
    row = page.locator('tr[data-endpoint="act"]')
    pending = row.locator('td[data-field="pending"]')
    pause = row.locator('button[data-action="pause"]')
    await expect(row).to_be_visible(timeout=10_000)
    await expect(page.locator("#dispatcher-count")).to_have_text("1 alive", timeout=10_000)
    await expect(page.locator("#database-state")).to_have_text("ok")

    # Paused: dispatch stops, submits are still accepted.
    await pause.click()
    await expect(pause).to_have_text("resume")
    await expect(row.locator('td[data-field="id"]')).to_have_text("act (paused)")
    assert (await _admin(served, "GET", "/admin/v1/endpoints/act"))["paused"] is True
    waiting = [await gateway.submit(auth, url, body=str(i)) for i in range(5)]
    await expect(pending).to_have_text("5")

    # Purge asks first: dismissed, nothing happens; accepted, every pending task is cancelled.
    answers = iter([False, True])

    async def answer(dialog: Dialog) -> None:
        assert "Cancel 5 pending tasks of act" in dialog.message
        await (dialog.accept() if next(answers) else dialog.dismiss())

    page.on("dialog", answer)
    purge = row.locator('button[data-action="purge"]')
    await purge.click()
    await asyncio.sleep(0.5)
    await expect(pending).to_have_text("5")
    await purge.click()
    await expect(page.locator("#notice")).to_have_text("act: 5 tasks cancelled")
    await expect(pending).to_have_text("0")
    for t in waiting:
        assert (await gateway.status(auth, t["task_id"]))["task_status"] == "cancelled"
    await pause.click()
    await expect(pause).to_have_text("pause")
    assert (await _admin(served, "GET", "/admin/v1/endpoints/act"))["paused"] is False

    # A failed task, found in the endpoint's failed tasks, retried from its drill-down.
    failing = await gateway.submit(auth, url, body="doomed", headers={"X-Mock-Status": ["400"]})
    tid = failing["task_id"]
    for _ in range(100):
        if (await _admin(served, "GET", f"/admin/v1/tasks/{tid}"))["task_status"] == "failed":
            break
        await asyncio.sleep(0.1)
    await row.locator('td[data-field="id"]').click()
    await expect(page.locator("#tasks-panel")).to_be_visible()
    await page.locator('#task-tabs button[data-status="failed"]').click()
    task_row = page.locator(f'#task-rows tr[data-task="{tid}"]')
    await expect(task_row).to_be_visible()
    await task_row.click()
    await expect(page.locator("#detail-status")).to_have_text("failed")
    await expect(page.locator("#detail-request")).to_contain_text('"body": "doomed"')
    await expect(page.locator("#detail-fields")).to_contain_text("attempts1")
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-drilldown.png"), full_page=True)
    await page.locator("#detail-retry").click()
    await expect(page.locator("#notice")).to_have_text(f"{tid}: runs again")
    for _ in range(100):  # it ran again
        if len(mock_log(fresh_upstream)) == 2:
            break
        await asyncio.sleep(0.1)
    assert [c["body"] for c in mock_log(fresh_upstream)] == ["doomed", "doomed"]

    # A reload charts the history the server sampled before this page was opened.
    for _ in range(200):
        samples = (await _admin(served, "GET", "/admin/v1/history"))["endpoints"]["act"]
        if samples and time.time() * 1000 - samples[0][0] >= 8000:
            break
        await asyncio.sleep(0.1)
    await page.reload()
    await expect(page.locator("#chart-title")).to_have_text("act", timeout=10_000)
    await expect(page.locator("#chart")).to_have_attribute(
        "aria-label", re.compile(r"last (\d\d+|[89]) s"), timeout=3000)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-actions.png"), full_page=True)
    print(f"\nscreenshots: {ARTIFACTS / 'dashboard-drilldown.png'}, "
          f"{ARTIFACTS / 'dashboard-actions.png'}")
    await _paused_by_upstream_shown(gateway, served, fresh_upstream, page)
    await _proxied_task_shown(gateway, served, fresh_upstream, page)
    assert errors == []


async def _proxied_task_shown(gateway: Gateway, served: str, upstream: str, page: Any) -> None:
    """A proxied request the upstream failed is among its endpoint's failed tasks, of type
    `proxy`, with no retry offered (the admin API refuses one: its caller is gone)."""
    from playwright.async_api import expect

    await gateway.add_endpoint("prox", f"{upstream}/v1", proxy=True, forward_headers=[])
    auth = await gateway.new_key(user_id=7)
    async with httpx.AsyncClient(base_url=served, headers=auth, timeout=30) as http:
        r = await http.post("/proxy/prox/chat", json={}, headers={"X-Mock-Status": "500"})
    assert r.status_code == 500, r.text
    tid = r.headers["x-queue-task-id"]
    await page.locator('tr[data-endpoint="prox"] td[data-field="id"]').click()
    await page.locator('#task-tabs button[data-status="failed"]').click()
    await page.locator(f'#task-rows tr[data-task="{tid}"]').click()
    await expect(page.locator("#detail-status")).to_have_text("failed")
    await expect(page.locator("#detail-fields")).to_contain_text("typeproxy")
    await expect(page.locator("#detail-fields")).to_contain_text("result status500")
    await expect(page.locator("#detail-retry")).to_be_hidden()
    await expect(page.locator("#detail-cancel")).to_be_hidden()


async def _paused_by_upstream_shown(gateway: Gateway, served: str, upstream: str,
                                    page: Any) -> None:
    """An endpoint whose upstream answered 429 with Retry-After: its row says until when
    (the time the admin API gives, as the browser writes it)."""
    from playwright.async_api import expect

    url = f"{upstream}/upst"
    await gateway.add_endpoint("upst", url)
    auth = await gateway.new_key(user_id=6)
    await gateway.submit(auth, url, headers={
        "X-Mock-Status": ["429"], "X-Mock-Reply-Headers": [json.dumps({"Retry-After": "60"})]})
    for _ in range(100):
        queues = (await _admin(served, "GET", "/admin/v1/queues"))["endpoints"]
        (shown,) = [q for q in queues if q["id"] == "upst"]
        if shown["upstream_paused_until"]:
            break
        await asyncio.sleep(0.1)
    await gateway.submit(auth, url)  # waits in line behind the pause
    queues = (await _admin(served, "GET", "/admin/v1/queues"))["endpoints"]
    (shown,) = [q for q in queues if q["id"] == "upst"]
    assert shown["binding_limit"] == "upstream" and shown["admits_next_at"]
    until = await page.evaluate("(t) => new Date(t).toLocaleTimeString()",
                                shown["admits_next_at"])
    await expect(page.locator('tr[data-endpoint="upst"] td[data-field="id"]')).to_have_text(
        f"upst (paused by upstream until {until})", timeout=10_000)


async def test_ten_endpoints_fit_a_1280_pixel_screen_with_a_favicon(
    gateway: Gateway, served: str, upstream: str, browser: object
) -> None:
    """Every row's buttons on screen at 1,280 px wide with 10 busy endpoints (they sat off
    it at 1,400 px with 7), and the tab has an icon of its own."""
    from playwright.async_api import Browser, expect

    assert isinstance(browser, Browser)
    auth = await gateway.new_key(user_id=8)
    for i in range(10):
        url = f"{upstream}/wide-endpoint-number-{i}"
        await gateway.add_endpoint(f"wide-endpoint-number-{i}", url, max_concurrency=1,
                                   rate=1, interval_ms=60_000, paused=True)
        for _ in range(3):
            await gateway.submit(auth, url)
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.goto(f"{served}/dashboard#token={ADMIN}")
    rows = page.locator("#rows tr")
    await expect(rows).to_have_count(10, timeout=10_000)
    await expect(rows.first.locator('td[data-field="pending"]')).to_have_text("3")
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-1280.png"), full_page=True)
    off = await page.evaluate("""() => [...document.querySelectorAll('button')]
        .filter(b => b.offsetParent !== null)
        .map(b => [b.textContent, b.getBoundingClientRect().right])
        .filter(([, right]) => right > window.innerWidth)""")
    assert off == [], off
    assert await page.evaluate("document.documentElement.scrollWidth") <= 1280
    icon = await page.evaluate("document.querySelector('link[rel=icon]')?.href")
    assert icon, "no favicon link"
    r = httpx.get(icon)
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/"), r
    assert httpx.get(f"{served}/favicon.ico").status_code == 200  # what browsers ask for


async def test_dead_letters_searched_and_retried_from_the_dashboard(
    gateway: Gateway, served: str, fresh_upstream: str, browser: object
) -> None:
    """The search panel: failed tasks of every endpoint in one tab, any task found by its id
    or the id's beginning, and "retry all shown" after a confirm runs each again."""
    from playwright.async_api import Browser, Dialog, expect

    assert isinstance(browser, Browser)
    for e in ("dl-x", "dl-y"):
        await gateway.add_endpoint(e, f"{fresh_upstream}/{e}", max_retries=0)
    auth = await gateway.new_key(user_id=5)
    ids = [(await gateway.submit(auth, f"{fresh_upstream}/{e}", body=f"{e}{i}",
                                 headers={"X-Mock-Status": ["500"]}))["task_id"]
           for e in ("dl-x", "dl-y") for i in range(2)]
    for tid in ids:
        for _ in range(100):
            if (await _admin(served, "GET", f"/admin/v1/tasks/{tid}"))["task_status"] == \
                    "failed":
                break
            await asyncio.sleep(0.1)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"{served}/dashboard#token={ADMIN}")
    rows = page.locator("#search-rows tr")
    await expect(rows).to_have_count(4, timeout=10_000)  # the failed tab, every endpoint
    await expect(page.locator('#search-tabs button[data-status="failed"]')).to_have_attribute(
        "aria-selected", "true")
    assert sorted(await rows.evaluate_all("rs => rs.map(r => r.dataset.task)")) == sorted(ids)
    await expect(page.locator("#search-rows")).to_contain_text("dl-y")

    # Any task by its id's beginning, or whole.
    await page.locator("#search-id").fill(ids[2][:34])  # through the dot: one endpoint's
    await page.locator("#search-form button").click()
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_have_attribute("data-task", ids[2])
    await page.locator("#search-id").fill(ids[0])
    await page.locator("#search-id").press("Enter")
    await expect(page.locator("#search-info")).to_have_text("failed task of dl-x")
    await page.locator("#search-id").fill("NOT AN ID")
    await page.locator("#search-form button").click()
    await expect(page.locator("#search-info")).to_contain_text("cannot search")

    # Retry all shown: dismissed, nothing runs; accepted, each runs again.
    answers = iter([False, True])

    async def answer(dialog: Dialog) -> None:
        assert "Run the 4 failed tasks shown again" in dialog.message
        await (dialog.accept() if next(answers) else dialog.dismiss())

    page.on("dialog", answer)
    await page.locator('#search-tabs button[data-status="failed"]').click()
    await expect(rows).to_have_count(4)
    retry = page.locator("#retry-shown")
    await retry.click()
    await asyncio.sleep(0.5)
    assert len(mock_log(fresh_upstream)) == 4
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-dead-letters.png"), full_page=True)
    await retry.click()
    await expect(page.locator("#notice")).to_have_text("4 of 4 tasks run again")
    for _ in range(100):
        if len(mock_log(fresh_upstream)) == 8:
            break
        await asyncio.sleep(0.1)
    assert sorted(cast(str, c["body"]) for c in mock_log(fresh_upstream)) == sorted(
        [f"{e}{i}" for e in ("dl-x", "dl-y") for i in range(2)] * 2)
    assert errors == []
