"""The Redis Cluster that cluster tests run on (ClusterSetup in tests/servers.py), proved with
redis-py's own cluster client alone: keys spread over the three masters, and a master killed
with kill -9 is replaced by its replica with every key it acknowledged still readable."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import cast

import uvloop
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from app import redis_url
from tests.topologies import ClusterSetup


async def connect(cluster: ClusterSetup, first: int = 0) -> RedisCluster:
    """A fresh client that knows only the seed list (the three first masters), the one on
    port `first` tried first."""
    seeds = sorted(cluster.seeds, key=lambda seed: seed[1] != first)
    rc = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in seeds],
                      decode_responses=True)
    await rc.initialize()
    return rc


async def write(rc: RedisCluster, keys: list[str]) -> None:
    """One pipeline: the client splits it per master (300 concurrent SETs would not fit
    its per-node connection limit)."""
    async with rc.pipeline() as pipe:
        for key in keys:
            pipe.set(key, key)
        assert await pipe.execute() == [True] * len(keys)


async def test_keys_spread_over_the_three_masters(redis_cluster: ClusterSetup) -> None:
    keys = [f"{uuid.uuid4().hex[:8]}:{i}" for i in range(300)]
    assert len({key_slot(k.encode()) for k in keys}) > 250
    rc = await connect(redis_cluster)
    try:
        masters = rc.get_primaries()
        assert sorted(m.port for m in masters) == sorted(p for _, p in redis_cluster.seeds)
        before = [await rc.dbsize(target_nodes=m) for m in masters]
        await write(rc, keys)
        held = [await rc.dbsize(target_nodes=m) - b for m, b in zip(masters, before, strict=True)]
        assert sum(held) == 300 and all(50 <= n <= 150 for n in held), held
        assert await rc.mget_nonatomic(keys) == keys
    finally:
        await rc.aclose()


async def test_a_killed_master_is_replaced_by_its_replica(own_cluster: ClusterSetup) -> None:
    keys = [f"k:{i}" for i in range(100)]
    rc = await connect(own_cluster)
    try:
        await write(rc, keys)
        for master in rc.get_primaries():  # the replicas hold every key before a master dies
            assert await rc.execute_command("WAIT", 1, 5000, target_nodes=master) == 1
    finally:
        await rc.aclose()

    victim = own_cluster.master_for(keys[0])
    assert ("127.0.0.1", own_cluster.ports[victim]) in own_cluster.seeds
    own_cluster.kill_master(victim)
    took = await asyncio.to_thread(own_cluster.wait_promoted, victim)
    print(f"promotion took {took:.2f} s")
    assert own_cluster.master_for(keys[0]) != victim

    rc = await connect(own_cluster, first=own_cluster.ports[victim])  # a dead seed
    try:
        assert await rc.mget_nonatomic(keys) == keys
        fresh = [f"after:{i}" for i in range(100)]
        await write(rc, fresh)
        assert await rc.mget_nonatomic(fresh) == fresh
    finally:
        await rc.aclose()

    await asyncio.to_thread(own_cluster.restart, victim)  # back, as a replica
    assert own_cluster.master_for(keys[0]) != victim


async def _writes_while_closed(url: str) -> Counter[str]:
    """50 writers (commands and pipelines) while every node's connections are closed under
    them again and again, as redis-py does when a node stops answering: their errors by kind."""
    rc = redis_url.client(url, 2.0)
    await redis_url.connect(rc)
    errors: Counter[str] = Counter()

    async def write(i: int) -> None:
        for j in range(30):  # across close_all's rounds; 100 took 17-20 s in the suite
            try:
                await rc.set(f"closed-under-us:{i}", j)
                pipe = rc.pipeline()
                pipe.set(f"closed-under-us:{i}", j)
                await pipe.execute()
            except Exception as exc:  # counted by kind below
                errors[type(exc).__name__] += 1

    async def close_all() -> None:
        for _ in range(80):
            for node in cast(RedisCluster, rc).get_nodes():
                await node.disconnect()
            await asyncio.sleep(0.002)

    try:
        await asyncio.gather(*(write(i) for i in range(50)), close_all())
    finally:
        await rc.aclose()
    return errors


async def test_a_connection_closed_while_in_use_is_a_connection_error(
    redis_cluster: ClusterSetup,
) -> None:
    """redis-py closes every connection of a node it thinks dead, also those other tasks are
    writing on; the write then fails inside asyncio (AttributeError), which the gateway read as
    a bug: a 500 from the API and an executor error in the dispatcher in the middle of a
    failover. Our client makes it the ConnectionError it is (app/redis_url.py)."""
    errors = await _writes_while_closed(redis_cluster.url)
    assert errors["ConnectionError"] > 0, errors  # the race did happen
    assert set(errors) == {"ConnectionError"}, errors


def test_under_uvloop_too(redis_cluster: ClusterSetup) -> None:
    """`qgw serve` runs on uvloop, whose transport says so with a RuntimeError ("the handler
    is closed"): a ConnectionError as well."""
    errors = uvloop.run(_writes_while_closed(redis_cluster.url))
    assert errors["ConnectionError"] > 0, errors
    assert set(errors) == {"ConnectionError"}, errors
