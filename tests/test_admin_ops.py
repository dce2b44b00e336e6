"""What the dashboard shows beyond the queues (app/routes/admin_ops.py): dispatchers alive
with their calls in flight, the outbox backlog, the database's state, and the history the
server samples so a reload shows the last hour."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from app.lifecycle.history import HistorySampler
from app.runtime import Runtime
from tests.conftest import Gateway


async def _overview(gateway: Gateway) -> Any:
    r = await gateway.http.get("/admin/v1/overview", headers=gateway.admin)
    assert r.status_code == 200, r.text
    return r.json()


async def test_overview_names_live_dispatchers_with_their_calls_in_flight(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
) -> None:
    url = f"{upstream}/beat"
    await gateway.add_endpoint("beat", url, max_concurrency=4)
    auth = await gateway.new_key()
    first = await _overview(gateway)
    assert first["dispatchers"] == [] and first["database"] == "ok"
    assert first["outbox_backlog"] == 0
    d = await start_dispatcher()
    for _ in range(3):
        await gateway.submit(auth, url, headers={"X-Mock-Latency-Ms": ["2500"]})
    seen: list[Any] = []
    for _ in range(60):
        seen = (await _overview(gateway))["dispatchers"]
        if seen and seen[0]["in_flight"] == 3:
            break
        await asyncio.sleep(0.1)
    assert len(seen) == 1 and seen[0]["in_flight"] == 3, seen
    assert d.dispatcher is not None and seen[0]["id"] == d.dispatcher.ident
    assert seen[0]["per_endpoint"] == {"beat": 3} and seen[0]["age_s"] <= 2
    await d.stop(grace_s=5)  # a clean stop leaves the list at once
    assert (await _overview(gateway))["dispatchers"] == []
    # A heartbeat that stopped long ago is pruned by the reader.
    await gateway.rt.redis.hset(gateway.rt.keys.dispatchers, "ghost", '{"at": 1}')
    assert (await _overview(gateway))["dispatchers"] == []
    assert not await gateway.rt.redis.hexists(gateway.rt.keys.dispatchers, "ghost")


async def test_one_process_samples_the_history_each_interval(gateway: Gateway, upstream: str
                                                             ) -> None:
    rt = gateway.rt
    await gateway.add_endpoint("hist", f"{upstream}/hist")
    auth = await gateway.new_key()
    for _ in range(3):
        await gateway.submit(auth, f"{upstream}/hist")
    samplers = [HistorySampler(rt.redis, rt.keys, rt.registry) for _ in range(3)]
    took = [await s.tick() for s in samplers]
    assert sorted(took) == [False, False, True]  # one sample per interval, whoever ticks
    assert not any([await s.tick() for s in samplers])
    r = await gateway.http.get("/admin/v1/history", headers=gateway.admin,
                               params={"endpoints": "hist"})
    body = r.json()
    assert body["fields"] == ["t", "depth", "in_flight", "done", "failed"]
    (sample,) = body["endpoints"]["hist"]
    assert sample[1:] == [3, 0, 0, 0]
    await samplers[0].sample(sample[0] + 10_000)
    samples = (await gateway.http.get("/admin/v1/history", headers=gateway.admin)).json()
    assert [s[0] for s in samples["endpoints"]["hist"]] == [sample[0], sample[0] + 10_000]
