"""GET /metrics and GET /admin/v1/queues: counters kept by the scripts, one round trip a scrape."""

from __future__ import annotations

import asyncio
import json
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio.client import Pipeline, Redis

from app import __version__
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway
from tests.test_storage import Outage, SqliteOutageCase, run_dispatcher

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(metrics: dict[Any, float], name: str, endpoint: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted({"endpoint": endpoint, **labels}.items())))]


async def scrape(gateway: Gateway) -> dict[Any, float]:
    r = await gateway.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    for _ in range(int(timeout / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_counters_and_histograms_follow_the_tasks(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/metered"
    await gateway.add_endpoint("metered", url, max_retries=1, retry_backoff_ms=0)
    auth = await gateway.new_key()
    ok = [await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["30"]})
          for _ in range(3)]
    bad = await gateway.submit(auth, url, headers={"X-Mock-Status": ["400"]})
    flaky = await gateway.submit(auth, url, headers={"X-Mock-Status": ["503"]})
    gone = await gateway.submit(auth, url)
    r = await gateway.http.post(f"/api/v1/tasks/{gone['task_id']}/cancel", headers=auth)
    assert r.status_code == 200

    m = await scrape(gateway)
    assert value(m, "qgw_tasks_submitted_total", "metered") == 6
    assert value(m, "qgw_tasks_cancelled_total", "metered") == 1
    assert value(m, "qgw_queue_pending", "metered") == 5
    assert value(m, "qgw_queue_wait_seconds_count", "metered") == 0

    await start_dispatcher()
    done = await gateway.wait_finished(auth, [t["task_id"] for t in [*ok, bad, flaky]])
    assert [d["task_status"] for d in done] == ["completed"] * 3 + ["failed"] * 2

    m = await scrape(gateway)
    counts = {c: value(m, f"qgw_tasks_{c}_total", "metered")
              for c in ("submitted", "admitted", "completed", "failed", "retried", "cancelled")}
    # The retry is claimed again, as a new admission.
    assert counts == {"submitted": 6, "admitted": 6, "completed": 3, "failed": 2, "retried": 1,
                      "cancelled": 1}
    assert value(m, "qgw_queue_pending", "metered") == 0
    assert value(m, "qgw_queue_in_flight", "metered") == 0
    # Every first start is one queue-wait observation; only successful calls time the upstream.
    assert value(m, "qgw_queue_wait_seconds_count", "metered") == 5
    assert value(m, "qgw_queue_wait_seconds_bucket", "metered", le="+Inf") == 5
    assert value(m, "qgw_upstream_latency_seconds_count", "metered") == 3
    assert value(m, "qgw_upstream_latency_seconds_bucket", "metered", le="0.025") == 0
    # 30 ms calls: none under 25 ms; all under 1 s (a loaded host made one take over 50 ms)
    assert value(m, "qgw_upstream_latency_seconds_bucket", "metered", le="1") == 3
    assert value(m, "qgw_upstream_latency_seconds_sum", "metered") >= 0.09
    assert value(m, "qgw_submit_latency_seconds_count", "metered") >= 6  # this process's


async def test_a_rate_limited_claim_is_counted(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/slowrate"
    await gateway.add_endpoint("slowrate", url, rate=1, interval_ms=60_000)
    auth = await gateway.new_key()
    first, _second = [await gateway.submit(auth, url) for _ in range(2)]
    await start_dispatcher()
    await gateway.wait_finished(auth, [first["task_id"]])

    async def limited() -> bool:
        return value(await scrape(gateway), "qgw_claim_attempts_limited_total", "slowrate") >= 1

    await wait_until(limited)
    m = await scrape(gateway)
    # Claim attempts, not tasks: named so (qgw_tasks_* count tasks).
    assert not any(name == "qgw_tasks_limited_total" for name, _ in m)
    assert value(m, "qgw_tasks_admitted_total", "slowrate") == 1
    assert value(m, "qgw_queue_pending", "slowrate") == 1
    # The one in line waits out the minute since the first admission, a new task one more.
    assert 110 < value(m, "qgw_estimated_wait_seconds", "slowrate") <= 120


async def test_admin_queues_has_what_the_dashboard_shows(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/viewed"
    await gateway.add_endpoint("viewed", url, max_concurrency=2, rate=100, avg_exec_ms=400)
    auth = await gateway.new_key()
    fine = [await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["20"]})
            for _ in range(4)]
    bad = await gateway.submit(auth, url, headers={"X-Mock-Status": ["404"]},
                               body="secret-free body")
    before = (await gateway.http.get("/admin/v1/queues", headers=gateway.admin)).json()
    (q,) = [e for e in before["endpoints"] if e["id"] == "viewed"]
    assert q["pending"] == 5 and q["in_flight"] == 0 and q["submitted"] == 5
    assert q["oldest_pending_age_s"] is not None and q["oldest_pending_age_s"] >= 0
    # Nothing measured yet: 5 ahead, 2 slots of avg_exec_ms 400 ms, the first half a gap away.
    assert q["wait_time_new_s"] == pytest.approx((6 - 2 - 0.5) * 0.4 / 2)
    assert q["max_concurrency"] == 2 and q["rate_limit_per_s"] == 100

    await start_dispatcher()
    await gateway.wait_finished(auth, [t["task_id"] for t in [*fine, bad]])
    after = (await gateway.http.get("/admin/v1/queues", headers=gateway.admin)).json()
    (q,) = [e for e in after["endpoints"] if e["id"] == "viewed"]
    assert q["pending"] == 0 and q["oldest_pending_age_s"] is None and q["wait_time_new_s"] == 0
    assert q["completed"] == 4 and q["failed"] == 1 and q["admitted"] == 5
    assert q["throughput_per_s"] > 0 and q["admitted_per_s"] > 0
    assert q["exec_ms"] >= 20 and q["slot_ms"] >= q["exec_ms"] * 0.5
    assert q["admitted_last_window"] is not None
    (failure,) = q["recent_failures"]
    assert failure["task_id"] == bad["task_id"] and failure["code"] == 404
    r = await gateway.http.get("/admin/v1/queues")
    assert r.status_code == 401


async def test_admin_queues_counts_the_window_by_the_redis_clock(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sliding window's admissions are stamped by Redis: the admin view counts them back from
    the same clock, not the API host's (an hour ahead here: it counted none)."""
    url = f"{upstream}/windowed"
    await gateway.add_endpoint("windowed", url, rate=100, interval_ms=60_000)
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(3)]
    await start_dispatcher()
    await gateway.wait_finished(auth, ids)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
    monkeypatch.undo()
    (q,) = [e for e in r.json()["endpoints"] if e["id"] == "windowed"]
    assert q["admitted_last_window"] == 3


async def test_oldest_pending_age_sees_a_band_starved_behind_newer_higher_ones(
    gateway: Gateway, upstream: str
) -> None:
    """Strict priority: the task waiting longest may sit in a middle band, behind newer VIP
    tasks and ahead of newer priority-0 ones."""
    url = f"{upstream}/starved"
    await gateway.add_endpoint("starved", url)
    auth = await gateway.new_key()
    await gateway.submit(auth, url, priority=1)
    await asyncio.sleep(0.6)
    for priority in (3, 2, 0):
        await gateway.submit(auth, url, priority=priority)
    view = (await gateway.http.get("/admin/v1/queues", headers=gateway.admin)).json()
    (q,) = [e for e in view["endpoints"] if e["id"] == "starved"]
    assert q["pending"] == 4 and q["oldest_pending_age_s"] >= 0.6


async def test_a_scrape_of_1000_endpoints_is_one_round_trip(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = gateway.rt
    mirror = rt.registry.mirror
    rows = {f"ep{i:04d}": json.dumps({"id": f"ep{i:04d}",
                                      "target_url": f"http://127.0.0.1:9/ep{i}",
                                      "max_concurrency": 4})
            for i in range(1000)}
    await rt.redis.hset(mirror.hash_key, mapping=rows)  # type: ignore[arg-type]
    await rt.redis.incr(mirror.version_key)
    await rt.redis.hincrby(rt.keys.stats("ep0999"), "completed", 7)
    await mirror.refresh()
    assert len(rt.registry.all()) == 1000

    await scrape(gateway)  # a Redis new to this test run loads the oldest-pending script first
    pipelines: list[int] = []
    commands: list[tuple[Any, ...]] = []
    real_execute, real_command = Pipeline.execute, Redis.execute_command

    async def counted_execute(self: Pipeline, raise_on_error: bool = True) -> Any:
        pipelines.append(len(self.command_stack))
        return await real_execute(self, raise_on_error)

    async def counted_command(self: Redis, *args: Any, **options: Any) -> Any:
        if self is rt.redis:
            commands.append(args)
        return await real_command(self, *args, **options)  # type: ignore[no-untyped-call]  # untyped in redis-py

    monkeypatch.setattr(Pipeline, "execute", counted_execute)
    monkeypatch.setattr(Redis, "execute_command", counted_command)
    m, *others = await asyncio.gather(*(scrape(gateway) for _ in range(4)))
    monkeypatch.undo()

    # TIME and the dispatchers' hash, then per endpoint ZCARD (queue), ZCARD (active), HGETALL
    # (stats), ZCARD (outbox), ZCARD (webhooks), EVALSHA (oldest pending), sent together, with
    # no SCRIPT EXISTS trip before them; scrapes at the same time share it.
    assert pipelines == [2 + 6 * 1000]
    assert all(o == m for o in others)
    # The only other commands may be the registry's own polling (GET of its version).
    assert [c for c in commands if c[:1] != ("GET",)] == []
    labels = {lab[0][1] for (name, lab) in m if name == "qgw_queue_pending"}
    assert len(labels) == 1000
    assert value(m, "qgw_tasks_completed_total", "ep0999") == 7
    assert value(m, "qgw_tasks_completed_total", "ep0000") == 0


async def test_failed_calls_are_counted_by_status_class_and_timed(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/failing"
    # A timeout long enough that no answer of the mock's is late on a loaded CI machine
    # (300 ms was met once by the 503's), and a slow call twice as long.
    await gateway.add_endpoint("failing", url, max_retries=1, retry_backoff_ms=0,
                               timeout_ms=1000)
    auth = await gateway.new_key()
    tasks = [
        await gateway.submit(auth, url, headers={"X-Mock-Status": ["400"],  # once, 60 ms
                                                 "X-Mock-Latency-Ms": ["60"]}),
        await gateway.submit(auth, url, headers={"X-Mock-Status": ["503"]}),  # twice
        await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["2500"]}),  # times out twice
        await gateway.submit(auth, url),
    ]
    await start_dispatcher()
    done = await gateway.wait_finished(auth, [t["task_id"] for t in tasks])
    assert [d["task_status"] for d in done] == ["failed"] * 3 + ["completed"]

    m = await scrape(gateway)
    by_class = {c: value(m, "qgw_upstream_failures_total", "failing", **{"class": c})
                for c in ("2xx", "3xx", "4xx", "5xx", "none")}
    # Retried attempts count as well as final ones; a timeout has no status.
    assert by_class == {"2xx": 0, "3xx": 0, "4xx": 1, "5xx": 2, "none": 2}
    failed = "qgw_upstream_failed_latency_seconds"
    assert value(m, f"{failed}_count", "failing") == 5
    # The two timeouts each took the endpoint's 1 s: above the 0.5 s bucket.
    assert value(m, f"{failed}_count", "failing") - value(
        m, f"{failed}_bucket", "failing", le="0.5") >= 2
    assert value(m, f"{failed}_sum", "failing") >= 2.0 + 0.06
    assert value(m, "qgw_upstream_latency_seconds_count", "failing") == 1  # successes only


async def test_http_requests_are_counted_by_route_template_and_status(
    gateway: Gateway, upstream: str
) -> None:
    url = f"{upstream}/routed"
    await gateway.add_endpoint("routed", url)
    auth = await gateway.new_key()
    tasks = [await gateway.submit(auth, url) for _ in range(2)]
    for headers in (auth, auth, {}):
        await gateway.http.get(f"/api/v1/tasks/{tasks[0]['task_id']}", headers=headers)
    assert (await gateway.http.get("/no/such/page")).status_code == 404

    m = await scrape(gateway)

    def requests(route: str, method: str, code: int) -> float:
        labels = {"route": route, "method": method, "code": str(code)}
        return m.get(("qgw_http_requests_total", tuple(sorted(labels.items()))), 0)

    assert requests("/api/v1/tasks", "POST", 202) == 2
    # One series for every task: the route's template, never the path.
    assert requests("/api/v1/tasks/{task_id}", "GET", 200) == 2
    assert requests("/api/v1/tasks/{task_id}", "GET", 401) == 1
    assert requests("unmatched", "GET", 404) == 1
    assert not any(tasks[0]["task_id"] in str(labels) for _, labels in m)
    build = ("qgw_build_info", (("python", platform.python_version()),
                                ("version", __version__)))
    assert m[build] == 1


async def test_dispatchers_alive_oldest_pending_age_and_configured_limits(
    gateway: Gateway, upstream: str, settings: Settings,
    start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    url = f"{upstream}/aged"
    await gateway.add_endpoint("aged", url, max_concurrency=3, rate=6, interval_ms=60_000)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, url)
    rt = gateway.rt
    crashed = json.dumps({"at": int(time.time() * 1000) - 61_000, "in_flight": 5})
    await rt.redis.hset(rt.keys.dispatchers, "1@crashed", crashed)
    await asyncio.sleep(0.3)

    m = await scrape(gateway)
    assert m[("qgw_dispatchers_alive", ())] == 0  # a minute-old entry is not alive
    assert not await rt.redis.hexists(rt.keys.dispatchers, "1@crashed")  # and is pruned
    assert value(m, "qgw_oldest_pending_age_seconds", "aged") >= 0.3
    assert value(m, "qgw_endpoint_max_concurrency", "aged") == 3
    assert value(m, "qgw_endpoint_rate_limit_per_second", "aged") == pytest.approx(0.1)

    async def alive(n: int) -> bool:
        return (await scrape(gateway))[("qgw_dispatchers_alive", ())] == n

    await start_dispatcher()
    async with run_dispatcher(settings):
        await wait_until(lambda: alive(2), timeout=10)
        await gateway.wait_finished(auth, [task["task_id"]])
    # One stopped: it says so on its way out, not ten seconds later.
    assert await alive(1)
    m = await scrape(gateway)
    assert ("qgw_oldest_pending_age_seconds", (("endpoint", "aged"),)) not in m  # none waits


class TestDatabaseOutage(SqliteOutageCase):

    async def test_database_down_and_the_outbox_backlog_show_in_metrics(
        self, gateway: Gateway, outage: Outage, upstream: str,
        start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        url = f"{upstream}/backlog"
        await gateway.add_endpoint("backlog", url)
        auth = await gateway.new_key()
        assert (await scrape(gateway))[("qgw_database_up", ())] == 1
        dispatcher = await start_dispatcher()
        outage.engines += [gateway.rt.engine, dispatcher.engine]
        await outage.down()
        try:
            assert (await gateway.http.get("/readyz")).json()["status"] == "degraded"
            # The scrape reuses the check /readyz just made.
            assert (await scrape(gateway))[("qgw_database_up", ())] == 0
            for _ in range(3):
                await gateway.submit(auth, url)

            async def backlog(n: int) -> bool:
                return value(await scrape(gateway), "qgw_outbox_backlog", "backlog") == n

            await wait_until(lambda: backlog(3))
        finally:
            await outage.up()
        await wait_until(lambda: backlog(0))
        # Nobody asks /readyz now: the scrape checks again itself, at most 5 s later.
        async def database_up() -> bool:
            return (await scrape(gateway))[("qgw_database_up", ())] == 1

        await wait_until(database_up, timeout=10)


def _exported(text: str) -> set[str]:
    """Every series name an exposition text offers (a histogram's with its suffixes)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names |= ({f"{name}{x}" for x in ("_bucket", "_count", "_sum")} if kind == "histogram"
                  else {name})
    return names


def _named(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:qgw|process)_[a-z0-9_]+)", expr))


async def test_the_dashboard_and_the_alert_rules_use_only_exported_metrics(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    tmp_path: Path
) -> None:
    url = f"{upstream}/charted"
    await gateway.add_endpoint("charted", url, max_retries=0, rate=10)
    auth = await gateway.new_key()
    tasks = [await gateway.submit(auth, url),
             await gateway.submit(auth, url, headers={"X-Mock-Status": ["500"]})]
    await start_dispatcher()
    await gateway.wait_finished(auth, [t["task_id"] for t in tasks])
    exported = _exported((await gateway.http.get("/metrics")).text)

    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        assert _named(expr) and _named(expr) <= exported, expr
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) >= 6
    for rule in alerts:
        assert _named(rule["expr"]) and _named(rule["expr"]) <= exported, rule["alert"]
    if promtool := shutil.which("promtool"):  # `make lint` checks the rules too
        # The panels' PromQL parses: checked as recording rules, Grafana's variables filled.
        as_rules = [{"record": f"panel:{i}", "expr": e.replace("$__rate_interval", "5m")
                     .replace("$endpoint", ".*")} for i, e in enumerate(exprs)]
        (tmp_path / "panels.yml").write_text(
            yaml.safe_dump({"groups": [{"name": "panels", "rules": as_rules}]}))
        for path in (DEPLOY / "prometheus" / "alerts.yml", tmp_path / "panels.yml"):
            done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                                  text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        _slots_panel_skips_uncapped_endpoints(promtool, exprs, tmp_path)


def _slots_panel_skips_uncapped_endpoints(promtool: str, exprs: list[str], tmp: Path) -> None:
    """The alert rules' own unit tests pass (a rate-only endpoint, max_concurrency 0, is never
    saturated), and the slot panel shows no +Inf for one: promtool evaluates it."""
    done = subprocess.run([promtool, "test", "rules",
                           str(DEPLOY / "prometheus" / "alerts.test.yml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (panel,) = [e for e in exprs if "qgw_endpoint_max_concurrency" in e]
    series = [(f'{name}{{endpoint="{e}"}}', f"{v}x5") for e, cap, busy in
              (("capped", 2, 1), ("rates", 0, 7))
              for name, v in (("qgw_queue_in_flight", busy),
                              ("qgw_endpoint_max_concurrency", cap))]
    test = {"evaluation_interval": "1m", "rule_files": [], "tests": [{
        "interval": "1m",
        "input_series": [{"series": n, "values": v} for n, v in series],
        "promql_expr_test": [{"expr": panel.replace("$endpoint", ".*"), "eval_time": "2m",
                              "exp_samples": [{"labels": '{endpoint="capped"}',
                                               "value": 0.5}]}]}]}
    (tmp / "panel.test.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run([promtool, "test", "rules", str(tmp / "panel.test.yml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


async def test_timestamps_and_rejections_are_named_as_prometheus_asks(
    gateway: Gateway, upstream: str
) -> None:
    """A point in time ends in _timestamp_seconds; refused submits are counted by reason."""
    await gateway.add_endpoint("named", f"{upstream}/named")
    auth = await gateway.new_key()
    before = await scrape(gateway)
    for body in ({"target_url": f"{upstream}/nowhere"}, {"target_url": "ftp://x/named"}):
        r = await gateway.http.post("/api/v1/tasks", headers=auth, json=body)
        assert r.status_code in (404, 422), r.text
    text = (await gateway.http.get("/metrics")).text
    assert "# TYPE qgw_endpoint_upstream_paused_until_timestamp_seconds gauge" in text
    assert "qgw_endpoint_upstream_paused_until_seconds" not in text
    after = samples(text)
    for reason in ("endpoint_not_registered", "invalid_request"):
        series = ("qgw_submit_rejections_total", (("reason", reason),))
        assert after[series] == before.get(series, 0) + 1, reason


async def test_an_operators_pause_shows_in_metrics(gateway: Gateway, upstream: str) -> None:
    await gateway.add_endpoint("held", f"{upstream}/held")
    m = await scrape(gateway)
    assert value(m, "qgw_endpoint_paused", "held") == 0
    assert value(m, "qgw_webhooks_pending", "held") == 0
    r = await gateway.http.patch("/admin/v1/endpoints/held", headers=gateway.admin,
                                 json={"paused": True})
    assert r.status_code == 200, r.text
    await wait_until(lambda: _paused(gateway), timeout=5)


async def _paused(gateway: Gateway) -> bool:
    return value(await scrape(gateway), "qgw_endpoint_paused", "held") == 1


async def _held(gateway: Gateway, endpoint: str) -> dict[str, Any]:
    """The admin view's row once the limiter holds the endpoint's line."""
    for _ in range(100):
        r = await gateway.http.get("/admin/v1/queues", headers=gateway.admin)
        row: dict[str, Any]
        (row,) = [q for q in r.json()["endpoints"] if q["id"] == endpoint]
        if row["binding_limit"]:
            return row
        await asyncio.sleep(0.1)
    raise AssertionError(f"{endpoint} never held: {row}")


async def test_metrics_name_the_limit_holding_the_line_and_when_it_admits_next(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """/metrics says what /admin/v1/queues says: which limit binds, and for how long."""
    url = f"{upstream}/held-by-rate"
    await gateway.add_endpoint("held-by-rate", url, rate=1, interval_ms=60_000,
                               max_concurrency=2, limits=[{"rate": 100, "interval_ms": 1000}])
    await gateway.add_endpoint("free", f"{upstream}/free")
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(2)]
    await start_dispatcher()
    await gateway.wait_finished(auth, ids[:1])
    assert (await _held(gateway, "held-by-rate"))["binding_limit"] == "rate"
    m = await scrape(gateway)
    limited = {lab["limit"]: v for (name, labels), v in m.items()
               if name == "qgw_endpoint_limited" and (lab := dict(labels))["endpoint"]
               == "held-by-rate"}
    assert limited == {"paused": 0, "upstream": 0, "rate": 1, "concurrency": 0,
                       "limits: 100/1000ms per request": 0}
    assert 50 < value(m, "qgw_endpoint_admits_next_seconds", "held-by-rate") <= 60
    assert value(m, "qgw_endpoint_limited", "free", limit="paused") == 0
    assert ("qgw_endpoint_admits_next_seconds", (("endpoint", "free"),)) not in m


async def test_the_admin_view_and_metrics_estimate_a_new_task_as_its_submit_does(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    """A limits-only 1-a-minute endpoint after one admission: the task in line waits for the
    limiter (about 60 s), a new one behind it a minute more; the admin view and the metric
    count the head's wait as the submit does."""
    url = f"{upstream}/held-eta"
    await gateway.add_endpoint("held-eta", url, limits=[{"rate": 1, "interval_ms": 60_000}])
    auth = await gateway.new_key()
    ids = [(await gateway.submit(auth, url))["task_id"] for _ in range(2)]
    await start_dispatcher()
    await gateway.wait_finished(auth, ids[:1])
    read = time.monotonic()
    row = await _held(gateway, "held-eta")
    metric = value(await scrape(gateway), "qgw_estimated_wait_seconds", "held-eta")
    held = await gateway.status(auth, ids[1])
    new = await gateway.submit(auth, url)
    # Read before the submit, they may be higher by the time that passed meanwhile (1.1 s
    # once on a loaded host, more than the submit's rounding up covered).
    since = time.monotonic() - read
    assert 50 < held["wait_time"] <= 60, held
    assert 110 < new["wait_time"] <= 120, new
    assert new["wait_time"] - 2 <= row["wait_time_new_s"] <= new["wait_time"] + since, row
    assert new["wait_time"] - 2 <= metric <= new["wait_time"] + since, metric
