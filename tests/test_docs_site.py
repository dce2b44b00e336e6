"""The documentation site: its reference pages are what the code generates now, it builds with
`mkdocs build --strict`, and the built pages work offline in headless Chromium (Mermaid diagrams
drawn, search answering) without one request leaving the file system. Saves screenshots to
.artifacts/."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import ROOT
from tests.test_dashboard import ARGS, ARTIFACTS, CHROMIUM

ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor


def test_generated_reference_pages_are_up_to_date() -> None:
    run = subprocess.run([sys.executable, "-m", "scripts.gen_reference", "--check"], cwd=ROOT,
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout


def test_the_check_names_a_page_that_no_longer_matches_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scripts import gen_reference

    monkeypatch.setenv("COLUMNS", os.environ.get("COLUMNS", "80"))  # pages() fixes it; restore
    monkeypatch.setattr(gen_reference, "OUT", tmp_path)
    made = gen_reference.pages()
    assert set(made) == {"http.md", "settings.md", "cli.md", "metrics.md"}
    assert gen_reference.pages() == made  # deterministic: the lead re-runs it after merging
    for name, text in made.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert gen_reference.stale(made) == []
    # What a settings change on another branch looks like before `make reference`.
    settings = tmp_path / "settings.md"
    settings.write_text(settings.read_text().replace("`QGW_LEASE_MS`", "`QGW_LEASE_S`"))
    assert gen_reference.stale(made) == ["settings.md"]
    # Every page says what it is generated from, and every source made it in.
    assert "`POST /api/v1/tasks`" in made["http.md"] and "#schema-taskview" in made["http.md"]
    assert "`QGW_REDIS_URL`" in made["settings.md"] and "`QGW_LOG_LEVEL`" in made["settings.md"]
    assert "`qgw endpoints add`" in made["cli.md"] and "`--limits LIMITS`" in made["cli.md"]
    assert "`qgw_queue_pending`" in made["metrics.md"]
    assert "`qgw_http_requests_total` | counter | `route`, `method`, `code`" in made["metrics.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                          str(out)], cwd=ROOT, capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr + run.stdout
    return out


@pytest.fixture
def page(site: Path) -> Iterator[object]:
    """A Chromium page that may load files only: any other request is refused and recorded."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            tab = browser.new_page(viewport={"width": 1280, "height": 900})
            tab.outside = []  # type: ignore[attr-defined]
            errors: list[str] = []
            tab.errors = errors  # type: ignore[attr-defined]

            def route(r: object) -> None:
                url = r.request.url  # type: ignore[attr-defined]
                if url.startswith(("file://", "data:", "blob:")):
                    r.continue_()  # type: ignore[attr-defined]
                else:
                    tab.outside.append(url)  # type: ignore[attr-defined]
                    r.abort()  # type: ignore[attr-defined]

            tab.route("**/*", route)
            tab.on("pageerror", lambda exc: errors.append(str(exc)))
            yield tab
        finally:
            browser.close()


def _open(tab: object, site: Path, name: str) -> None:
    tab.goto((site / name).as_uri())  # type: ignore[attr-defined]
    tab.wait_for_load_state("load")  # type: ignore[attr-defined]


def test_the_site_builds_strictly_and_draws_mermaid_offline(site: Path, page: object) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    for name, diagrams in (("concepts/tasks.html", 1), ("design.html", 2)):
        _open(page, site, name)
        # Material swaps each ```mermaid block for a drawn diagram: none may stay source text.
        expect(page.locator("div.mermaid")).to_have_count(diagrams, timeout=20_000)
        expect(page.locator("pre.mermaid")).to_have_count(0)
        for box in (page.locator("div.mermaid").nth(i).bounding_box()
                    for i in range(diagrams)):
            assert box is not None and box["height"] > 150 and box["width"] > 200, box
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"docs-{name.replace('/', '-')}.png"))
    assert page.outside == [], page.outside  # type: ignore[attr-defined]
    assert page.errors == [], page.errors  # type: ignore[attr-defined]


def test_the_built_pages_link_up_and_search_works_offline(site: Path, page: object) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    _open(page, site, "index.html")
    page.get_by_role("link", name="Quickstart").first.click()
    expect(page.locator("h1")).to_have_text("Quickstart¶")  # ¶: the heading's permalink
    expect(page.locator("code", has_text="make run").first).to_be_visible()
    page.locator(".md-search__input").first.click()
    page.keyboard.type("permit")  # keystrokes: Material searches on key events, not on fill()
    expect(page.locator(".md-search-result__item").first).to_be_visible(timeout=20_000)
    _open(page, site, "reference/http.html")
    # A pipe inside a pattern stays in its cell, as written: the row keeps its four columns.
    row = page.locator("tr", has=page.locator("code", has_text="target_url")).first
    expect(row.locator("td")).to_have_count(4)
    expect(row.locator("td").nth(2)).to_contain_text("(6553[0-5]|655[0-2]")
    page.screenshot(path=str(ARTIFACTS / "docs-reference-http.png"))
    assert page.outside == [], page.outside  # type: ignore[attr-defined]
    assert page.errors == [], page.errors  # type: ignore[attr-defined]


def test_the_contract_page_names_every_route_and_every_setting() -> None:
    """docs/api.md is written by hand: a route or a setting added to the code without a word
    there fails here. Routes are matched by method and path, path parameters by position
    (`{id}` in the page stands for `{endpoint_id}` in the code)."""
    import re

    from app.settings import Settings
    from scripts.ref_http import openapi

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    every = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    methods = "|".join([*every, "ANY"])
    said: set[tuple[str, str]] = set()
    for m in re.finditer(rf"`((?:{methods})(?:\|(?:{methods}))*) (/[^\s`?]*)`", text):
        path = re.sub(r"\{[^}]*\}", "{}", m[2])
        verbs = m[1].split("|")
        said.update((verb, path) for verb in (every if "ANY" in verbs else verbs))
    served = {(verb.upper(), re.sub(r"\{[^}]*\}", "{}", path))
              for path, ops in openapi()["paths"].items() for verb in ops}
    assert sorted(served - said) == [], "routes docs/api.md does not name as `METHOD /path`"
    unsaid = [f"QGW_{n.upper()}" for n in Settings.model_fields
              if f"`QGW_{n.upper()}`" not in text]
    assert unsaid == [], "settings docs/api.md does not name"
