"""Weighted shares (endpoint `fairness: "weighted"`, lua/includes/fairness.lua): a user takes as
many tasks a round as its key's tier weighs (`PUT /admin/v1/tiers/{tier}`)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest

from app.tiers import weight_of
from tests.conftest import Gateway
from tests.test_cli import answer, aqgw, refusal
from tests.test_fairness import _calls

pytestmark = pytest.mark.backends("single", "cluster")
WEIGHTS = {"gold": 3, "silver": 2, "bronze": 1}
WINDOW = 200


async def _key(gateway: Gateway, user_id: int, tier: str) -> dict[str, str]:
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin,
                                json={"user_id": user_id, "tier": tier})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def test_three_users_weighted_3_2_1_share_every_window_by_weight(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Deep backlogs (300, 200, 100: all last to the end), one slot: over any 200
    consecutive calls each user gets its share (50/33/17%) within 10% of it; wait_num at
    submit is the exact place in the order they run."""
    for tier, weight in WEIGHTS.items():
        r = await gateway.http.put(f"/admin/v1/tiers/{tier}", headers=gateway.admin,
                                   json={"weight": weight})
        assert r.status_code == 200 and r.json() == {"tier": tier, "weight": weight}, r.text
    url = f"{fresh_upstream}/weighted"
    await gateway.add_endpoint("weighted", url, max_concurrency=1, fairness="weighted")
    owner: dict[str, str] = {}
    answers = []
    for user, (tier, weight) in enumerate(WEIGHTS.items(), 1):
        auth = await _key(gateway, user, tier)
        for _ in range(100 * weight):
            task = await gateway.submit(auth, url)
            owner[task["task_id"]] = tier
            answers.append(task)
    dispatcher_process()
    order = await _calls(fresh_upstream, len(owner))
    total = sum(WEIGHTS.values())
    for start in range(len(order) - WINDOW + 1):
        window = [owner[t] for t in order[start:start + WINDOW]]
        for tier, weight in WEIGHTS.items():
            share = WINDOW * weight / total
            assert abs(window.count(tier) - share) <= share * 0.1, (start, tier)
    # The last user's tasks were submitted last, into turns the others had already filled:
    # its rank then was its place in the order.
    last = answers[-1]
    assert last["wait_num"] == order.index(last["task_id"])


@pytest.mark.parametrize("weight", [50, 65, 100])
async def test_a_weight_that_does_not_divide_128_takes_its_own_share(
    gateway: Gateway, weight: int,
) -> None:
    """A user of weight w submits a burst, then a user of weight 1 two tasks: the first goes
    in the current round (after the burst's first), the second after the burst's w of that
    round and the first of the next, not after 128/floor(128/w) of them (each submit rounded
    the burst's own last turn down to a 1/128 unit: weights 65 to 100 all took 128 a round)."""
    r = await gateway.http.put("/admin/v1/tiers/heavy", headers=gateway.admin,
                               json={"weight": weight})
    assert r.status_code == 200, r.text
    url = "http://127.0.0.1:9/shares"
    await gateway.add_endpoint("shares", url, fairness="weighted")
    heavy, light = await _key(gateway, 1, "heavy"), await _key(gateway, 2, "bronze")
    for _ in range(3 * weight):
        await gateway.submit(heavy, url)
    first, second = [await gateway.submit(light, url) for _ in range(2)]
    assert first["wait_num"] == 1
    assert second["wait_num"] == weight + 2


async def test_a_user_alone_gets_everything(
    gateway: Gateway, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Idle shares go to whoever waits: a weight-1 user alone runs at the full concurrency,
    in its own order, and its wait_num counts every task of its own ahead."""
    url = f"{fresh_upstream}/alone"
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        assert (await mock.post("/_mock/config", json={"latency_ms": 50})).status_code == 200
    await gateway.add_endpoint("alone", url, max_concurrency=4, fairness="weighted")
    auth = await _key(gateway, 7, "bronze")
    answers = [await gateway.submit(auth, url) for _ in range(40)]
    assert [a["wait_num"] for a in answers] == list(range(40))
    dispatcher_process()
    ids = [a["task_id"] for a in answers]
    assert sorted(await _calls(fresh_upstream, 40)) == sorted(ids)
    # Admitted in its own order. Four calls run at once, so their arrival order at the
    # upstream is the senders' race, not the line's: the admission times are what to check.
    started = [datetime.fromisoformat(s["started_at"])
               for s in await gateway.wait_finished(auth, ids)]
    assert started == sorted(started)
    async with httpx.AsyncClient(base_url=fresh_upstream) as mock:
        assert (await mock.get("/_mock/stats")).json()["peak_in_flight"] == 4


async def test_a_weight_is_checked(gateway: Gateway) -> None:
    for bad in ({"weight": 0}, {"weight": 101}, {"weight": "3"}, {}, {"weight": 2, "x": 1}):
        r = await gateway.http.put("/admin/v1/tiers/gold", headers=gateway.admin, json=bad)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"]
    r = await gateway.http.put("/admin/v1/tiers/" + "t" * 33, headers=gateway.admin,
                               json={"weight": 2})
    assert r.status_code == 422
    r = await gateway.http.get("/admin/v1/tiers", headers=gateway.admin)
    assert r.status_code == 200 and r.json() == []


async def test_qgw_tiers_set_reaches_every_process(gateway: Gateway, env: dict[str, str]) -> None:
    assert answer(await aqgw(env, "tiers", "set", "gold", "--weight", "3")) == {
        "tier": "gold", "weight": 3}
    assert answer(await aqgw(env, "tiers", "list")) == [{"tier": "gold", "weight": 3}]
    assert "weight" in refusal(await aqgw(env, "tiers", "set", "gold", "--weight", "0"), code=2)
    r = await gateway.http.get("/admin/v1/tiers", headers=gateway.admin)
    assert r.json() == [{"tier": "gold", "weight": 3}]
    for _ in range(50):  # this process's mirror hears of it (what its submits weigh by)
        if weight_of(gateway.rt.tiers.mirror, "gold") == 3:
            break
        await asyncio.sleep(0.1)
    assert weight_of(gateway.rt.tiers.mirror, "gold") == 3
