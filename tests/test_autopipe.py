"""Auto-pipelining (app/core/autopipe.py) against a real Redis: concurrent calls share a
connection and a write, each gets its own reply or error, and an outage fails calls fast."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError

from app.core.autopipe import BATCH_CALLS, AutoPipeline
from app.runtime import redis_client
from tests.servers import RedisServer

PUSH = "return {ARGV[1], redis.call('RPUSH', KEYS[1], ARGV[1])}"
FAIL = "return redis.error_reply('refused ' .. ARGV[1])"


@dataclass
class Piped:
    redis: Redis
    ap: AutoPipeline
    key: str  # a list of this test's own


@pytest.fixture
async def piped(redis_server: RedisServer) -> AsyncIterator[Piped]:
    r = redis_client(redis_server.url, 2.0)
    ap = AutoPipeline.of(r)
    assert ap is not None
    p = Piped(r, ap, f"ap:{uuid.uuid4().hex}")
    try:
        yield p
    finally:
        await r.delete(p.key)
        await r.aclose()


async def _connections(r: Redis) -> int:
    return int((await r.info("stats"))["total_connections_received"])


async def test_concurrent_calls_share_one_connection_in_order(piped: Piped) -> None:
    r, ap, key = piped.redis, piped.ap, piped.key
    await r.ping()  # the pool's first connection, before counting
    before = await _connections(r)
    n = 2 * BATCH_CALLS + 100  # three batches: none larger than the cap
    replies = await asyncio.gather(*(ap.execute("EVAL", PUSH, 1, key, i) for i in range(n)))
    assert [int(v) for v, _ in replies] == list(range(n))  # each its own reply
    assert sorted(int(c) for _, c in replies) == list(range(1, n + 1))
    assert [int(v) for v in await r.lrange(key, 0, -1)] == list(range(n))  # call order
    assert await _connections(r) == before  # the pooled connection carried them all


async def test_an_error_reply_is_its_callers_alone(piped: Piped) -> None:
    r, ap, key = piped.redis, piped.ap, piped.key
    calls = [ap.execute("EVAL", FAIL if i % 3 == 1 else PUSH, 1, key, i) for i in range(9)]
    calls.append(ap.execute("EVAL", PUSH, 1, key, None))  # Redis cannot take a None,
    calls.append(ap.execute("EVAL", PUSH, 1, key, "\ud800"))  # nor a lone surrogate
    *results, no_none, no_surrogate = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(no_none, DataError) and isinstance(no_surrogate, DataError)
    for i, res in enumerate(results):
        if i % 3 == 1:
            assert isinstance(res, ResponseError) and f"refused {i}" in str(res)
        else:
            assert isinstance(res, list) and int(res[0]) == i
    assert await r.llen(key) == 6


async def test_a_caller_that_gave_up_first_is_left_out(piped: Piped) -> None:
    r, ap, key = piped.redis, piped.ap, piped.key
    gone = ap.execute("EVAL", PUSH, 1, key, "gone")
    kept = ap.execute("EVAL", PUSH, 1, key, "kept")
    gone.cancel()  # before the batch is written
    assert (await kept)[0] == "kept"
    assert await r.lrange(key, 0, -1) == ["kept"]


async def test_redis_down_fails_calls_fast_then_recovers(own_redis: RedisServer) -> None:
    r = redis_client(own_redis.url, 1.0)
    try:
        ap = AutoPipeline.of(r)
        assert ap is not None
        assert (await ap.execute("EVAL", PUSH, 1, "k", "before"))[0] == "before"
        own_redis.stop()
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(
            *(ap.execute("EVAL", PUSH, 1, "k", i) for i in range(20)), return_exceptions=True), 5)
        assert all(isinstance(res, RedisConnectionError) for res in results), results
        assert time.monotonic() - started < 2.5
        own_redis.start()
        for _ in range(50):  # the server loads its append-only file
            try:
                assert (await ap.execute("EVAL", PUSH, 1, "k", "after"))[0] == "after"
                break
            except RedisConnectionError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no call succeeded after Redis came back")
        assert await r.lrange("k", 0, -1) == ["before", "after"]
    finally:
        await r.aclose()
