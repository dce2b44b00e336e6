"""Auto-pipelining (app/core/autopipe.py) against a real Redis: concurrent calls share a
connection and a write, each gets its own reply or error, and an outage fails calls fast; a
repeatable script call (app/core/scripts.py) outlives a connection lost under it."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, DataError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.core.autopipe import BATCH_CALLS, IDLE_S, AutoPipeline, PipelineClosed
from app.core.scripts import Lua
from app.runtime import redis_client
from tests.servers import RedisServer

PUSH = "return {ARGV[1], redis.call('RPUSH', KEYS[1], ARGV[1])}"
FAIL = "return redis.error_reply('refused ' .. ARGV[1])"
LOADING = "return redis.error_reply('LOADING Redis is loading the dataset in memory')"
# Busy for ARGV[1] seconds of the server's CPU time (the time TIME gives a script may stand
# still while it runs, in Valkey).
BUSY = "local s = os.clock() repeat until os.clock() - s >= tonumber(ARGV[1]) return ARGV[1]"


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


async def _connections(ap: AutoPipeline) -> int:
    """Connections Redis has accepted, asked on the auto-pipeline's own connection (which it
    keeps a moment after its last reply: a call through the pool would open another)."""
    info = await ap.execute("INFO", "stats")
    return int(re.search(r"total_connections_received:(\d+)", info).group(1))  # type: ignore[union-attr]


async def test_concurrent_calls_share_one_connection_in_order(piped: Piped) -> None:
    r, ap, key = piped.redis, piped.ap, piped.key
    await r.ping()  # the pool's first connection, before counting
    before = await _connections(ap)
    n = 2 * BATCH_CALLS + 100  # three batches: none larger than the cap
    replies = await asyncio.gather(*(ap.execute("EVAL", PUSH, 1, key, i) for i in range(n)))
    assert [int(v) for v, _ in replies] == list(range(n))  # each its own reply
    assert sorted(int(c) for _, c in replies) == list(range(1, n + 1))
    assert [int(v) for v in await ap.execute("LRANGE", key, 0, -1)] == list(range(n))  # in order
    assert await _connections(ap) == before  # the pooled connection carried them all


async def test_callers_calling_again_keep_their_order_on_one_connection(piped: Piped) -> None:
    """Ten callers, each calling again once answered: their calls go out while others' replies
    are owed (app/core/autopipe.py, WRITE_AT), on the one connection, each caller's in order."""
    r, ap, key = piped.redis, piped.ap, piped.key
    await r.ping()
    before = await _connections(ap)

    async def caller(c: int) -> list[str]:
        return [(await ap.execute("EVAL", PUSH, 1, key, f"{c}:{i}"))[0] for i in range(50)]

    answered = await asyncio.gather(*(caller(c) for c in range(10)))
    assert answered == [[f"{c}:{i}" for i in range(50)] for c in range(10)]
    pushed = await ap.execute("LRANGE", key, 0, -1)
    assert sorted(pushed) == sorted(v for a in answered for v in a)
    for c in range(10):
        assert [v for v in pushed if v.startswith(f"{c}:")] == answered[c]
    assert await _connections(ap) == before


async def test_large_calls_all_go_in_order(piped: Piped) -> None:
    """Calls of 768 KiB each, 24 at once: more than the transport may hold unsent; the rest
    wait for the replies owed and go after them."""
    ap, key = piped.ap, piped.key
    big = "x" * (768 << 10)
    replies = await asyncio.gather(*(ap.execute("EVAL", PUSH, 1, key, f"{i}:{big}")
                                     for i in range(24)))
    assert [int(v.partition(":")[0]) for v, _ in replies] == list(range(24))
    assert [int(c) for _, c in replies] == list(range(1, 25))


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


async def test_a_loading_reply_is_its_callers_alone(piped: Piped) -> None:
    """redis-py raises LOADING (a restarted Redis reading its file) as a ConnectionError; it
    is still one command's reply: the calls behind it get theirs, on the same connection."""
    r, ap, key = piped.redis, piped.ap, piped.key
    await r.ping()
    before = await _connections(ap)
    calls = [ap.execute("EVAL", LOADING if i == 2 else PUSH, 1, key, i) for i in range(6)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[2], BusyLoadingError)
    assert [int(res[0]) for res in results if isinstance(res, list)] == [0, 1, 3, 4, 5]
    assert await ap.execute("LLEN", key) == 5
    assert await _connections(ap) == before


async def test_a_connection_kept_idle_and_closed_by_redis_is_not_written_to(
    piped: Piped,
) -> None:
    """The reader keeps its connection a moment (IDLE_S) for the next calls; one Redis closed
    meanwhile (CLIENT KILL, as a restart would) is seen closed before anything is written on
    it: the next calls go on a new connection and succeed, as the pool's check would have
    them. Then, quiet for longer than IDLE_S, the connection goes back to the pool."""
    r, ap, key = piped.redis, piped.ap, piped.key
    held = await ap.execute("CLIENT", "ID")
    assert await r.client_kill_filter(_id=held) == 1
    await asyncio.sleep(IDLE_S / 5)  # the close reaches this process; the reader still waits
    results = await asyncio.gather(*(ap.execute("EVAL", PUSH, 1, key, i) for i in range(5)))
    assert [int(v) for v, _ in results] == list(range(5))
    assert await ap.execute("CLIENT", "ID") != held
    await asyncio.sleep(IDLE_S * 3)
    assert not list(r.connection_pool._get_in_use_connections())


class _Dropper:
    """A proxy in front of Redis that, once armed, closes the connection the next command
    comes on, unanswered: as a connection left from before a Redis restart fails after it
    passed the pool's check."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port, self.armed, self.dropped = redis_port, False, 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        await asyncio.gather(self._pipe(reader, up_writer, writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    client: asyncio.StreamWriter | None = None) -> None:
        while data := await src.read(65536):
            if client is not None and self.armed:  # a command from the client: dropped
                self.armed, self.dropped = False, self.dropped + 1
                client.close()
                break
            dst.write(data)
            await dst.drain()
        dst.close()


@pytest.mark.parametrize("batched", [True, False], ids=["auto-pipelined", "direct"])
async def test_a_repeatable_call_is_sent_again_after_its_connection_is_lost(
    redis_server: RedisServer, batched: bool
) -> None:
    proxy = _Dropper(redis_server.port)
    r = redis_client(await proxy.start(), 2.0)
    try:
        lua = Lua(r, "return ARGV[1]", AutoPipeline.of(r) if batched else None)
        await lua.load()
        proxy.armed = True
        with pytest.raises(RedisConnectionError, match="closed by server"):
            await lua(args=["once"])  # a plain call is never sent twice
        proxy.armed = True
        assert await lua.repeatable(args=["twice"]) == "twice"
        assert proxy.dropped == 2
    finally:
        await r.aclose()
        proxy.server.close()


async def test_a_group_goes_together_each_with_its_own_reply(piped: Piped) -> None:
    """Lua.together (execute_many): order kept, an error reply is its call's alone."""
    r, key = piped.redis, piped.key
    push, fail = Lua(r, PUSH, piped.ap), Lua(r, FAIL, piped.ap)
    await push.load()
    await fail.load()
    res = await Lua.together(r, [(push, [key], ["a"]), (fail, [key], ["b"]),
                                 (push, [key], ["c"])])
    assert res[0][0] == "a" and res[2] == ["c", 2]
    assert isinstance(res[1], ResponseError) and "refused b" in str(res[1])


async def test_a_reply_past_the_timeout_fails_the_calls_written_and_no_later_one(
    redis_server: RedisServer
) -> None:
    """A script slower than the socket timeout: it and the calls written behind it fail with
    TimeoutError; its late reply, on a dropped connection, reaches nobody; calls after it go
    on another connection and get their own replies."""
    r = redis_client(redis_server.url, 0.3)
    try:
        ap = AutoPipeline.of(r)
        assert ap is not None
        written = [ap.execute("EVAL", BUSY, 0, 1), *(ap.execute("EVAL", "return ARGV[1]", 0, i)
                                                  for i in range(3))]
        results = await asyncio.gather(*written, return_exceptions=True)
        assert all(isinstance(res, RedisTimeoutError) for res in results), results
        after = await asyncio.gather(*(ap.execute("EVAL", "return ARGV[1]", 0, f"after{i}")
                                       for i in range(3)), return_exceptions=True)
        while any(isinstance(res, BusyLoadingError | ResponseError | RedisTimeoutError)
                  for res in after):  # Redis is still running the slow script: BUSY
            await asyncio.sleep(0.2)
            after = await asyncio.gather(*(ap.execute("EVAL", "return ARGV[1]", 0,
                                                      f"after{i}") for i in range(3)),
                                         return_exceptions=True)
        assert after == ["after0", "after1", "after2"]
    finally:
        await r.aclose()


async def test_replies_that_keep_coming_are_not_timed_out(piped: Piped) -> None:
    """The timeout is for each reply, not for all those owed. Blocking pops of an empty list
    (never for real use here: they hold every call behind them) take their time without
    Redis's CPU: one of 1.2 s, and four of 0.3 s written behind it while it waits; on a
    timeout of 2 s replies are owed for 2.4 s, none comes more than 1.2 s after the one
    before, and all succeed."""
    ap, key = piped.ap, piped.key  # a client of a 2 s timeout
    started = time.monotonic()
    first = ap.execute("BLPOP", key, 1.2)
    await asyncio.sleep(0.1)
    behind = [ap.execute("BLPOP", key, 0.3) for _ in range(4)]
    assert await asyncio.gather(first, *behind) == [None] * 5
    assert time.monotonic() - started >= 2.3


async def test_calls_waiting_behind_a_lost_connection_go_on_another(
    redis_server: RedisServer
) -> None:
    proxy = _Dropper(redis_server.port)
    r = redis_client(await proxy.start(), 2.0)
    try:
        ap = AutoPipeline.of(r)
        assert ap is not None
        assert await ap.execute("EVAL", "return 'warm'", 0) == "warm"
        proxy.armed = True
        lost = ap.execute("EVAL", "return 'lost'", 0)
        for _ in range(3):  # its reader takes the connection and writes it
            await asyncio.sleep(0)
        behind = [ap.execute("EVAL", "return ARGV[1]", 0, i) for i in range(2)]
        with pytest.raises(RedisConnectionError):
            await lost
        assert await asyncio.gather(*behind) == ["0", "1"]
        assert proxy.dropped == 1
    finally:
        await r.aclose()
        proxy.server.close()


@pytest.mark.parametrize("turns", [0, 3], ids=["before-it-ran", "reading"])
async def test_stopping_fails_every_call_it_held(piped: Piped, turns: int) -> None:
    """Its task cancelled (shutdown) before it ran or while replies are owed: every caller
    gets an error, none waits forever, and later calls go on."""
    ap, key = piped.ap, piped.key
    calls = [ap.execute("EVAL", PUSH, 1, key, i) for i in range(3)]
    task = ap._task
    assert task is not None
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    assert all(isinstance(res, PipelineClosed | list) for res in results), results
    assert any(isinstance(res, PipelineClosed) for res in results) or turns, results
    assert (await ap.execute("EVAL", PUSH, 1, key, "after"))[0] == "after"


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


async def test_redis_py_still_has_what_the_auto_pipeline_reads(piped: Piped) -> None:
    """app/core/autopipe.py reads redis-py's private reader and writer: a redis-py that renamed
    them fails here by name (and the gateway falls back to plain calls, test below)."""
    import redis

    from app.core.autopipe import unsupported

    missing = unsupported(piped.redis.connection_pool)
    assert missing == [], (f"redis-py {redis.__version__} changed what app/core/autopipe.py "
                           f"reads: {missing}")
    conn = await piped.redis.connection_pool.get_connection()  # type: ignore[no-untyped-call]
    try:  # connected, they are the streams the module uses
        assert conn._writer is not None and conn._reader is not None
        assert conn._writer.transport.get_write_buffer_size() == 0
        assert not conn._reader.at_eof()
    finally:
        await piped.redis.connection_pool.release(conn)


async def test_a_redis_py_that_changed_them_gets_plain_calls(redis_server: RedisServer) -> None:
    """The fallback: a connection whose read_response lost a keyword the module passes (as
    a redis-py that changed it would): no auto-pipeline, and the scripts still answer,
    through redis-py's own calls."""
    from redis.asyncio.connection import Connection

    from app.core.scripts import Scripts

    class Changed(Connection):
        async def read_response(self, disable_decoding: bool = False,  # type: ignore[override]
                                timeout: float | None = None, *,
                                push_request: bool | None = False) -> object:
            return await super().read_response(disable_decoding, timeout,
                                               push_request=push_request)

    r = redis_client(redis_server.url, 2.0)
    key = f"ap:{uuid.uuid4().hex}"
    try:
        r.connection_pool.connection_class = Changed
        assert AutoPipeline.of(r) is None
        scripts = Scripts.register(r)
        assert scripts.confirm._batched is None  # every script: plain calls
        push = Lua(r, PUSH, AutoPipeline.of(r))
        assert [await push(keys=[key], args=[v]) for v in "xy"] == [["x", 1], ["y", 2]]
    finally:
        await r.delete(key)
        await r.aclose()
