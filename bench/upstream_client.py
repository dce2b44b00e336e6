"""Why the upstream client is our own (app/queue/http1.py): calls per second to the mock upstream
(latency 0) at several concurrencies through aiohttp's session (the client before it; httpx's
pool was slower still, up to 20x the CPU a call) and ours (through `call`, as the dispatcher
makes them), beside a raw keep-alive client (bench/_load.py) as the
ceiling of the mock itself, and the CPU each spends per call (on a 2-core machine the
dispatcher's CPU is what caps its calls per second). Bounded, loopback only."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.queue.upstream import Request, call, upstream_client
from bench._load import build_request, hammer, spawn
from tests.servers import QGW, free_port, stop, wait_port

CALLS = 2000
BODY = '{"prompt": "a cat"}'


@dataclass
class Rate:
    per_s: float
    cpu_us: float  # CPU per call


async def rate(one: Callable[[int], Awaitable[None]], concurrency: int) -> Rate:
    sem = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with sem:
            await one(i)

    start, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(limited(i) for i in range(CALLS)))
    spent, cpu = time.monotonic() - start, time.process_time() - cpu
    return Rate(CALLS / spent, cpu / CALLS * 1e6)


async def with_aiohttp(url: str, concurrency: int) -> Rate:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:
        async def one(i: int) -> None:
            async with client.post(url, data=BODY, headers={"Idempotency-Key": str(i)}) as resp:
                resp.raise_for_status()
                await resp.read()
        return await rate(one, concurrency)


async def with_ours(url: str, concurrency: int) -> Rate:
    client = upstream_client()
    req = Request("POST", url, '{"content-type": ["application/json"]}', "", BODY)
    try:
        async def one(i: int) -> None:
            outcome = await call(client, str(i), req, 30, 1 << 20)
            assert outcome.ok, outcome
        return await rate(one, concurrency)
    finally:
        await client.close()


async def main() -> None:
    port = free_port()
    mock = spawn([*QGW, "mock-upstream", "--port", str(port)])
    try:
        wait_port(port, 30, mock)
        url = f"http://127.0.0.1:{port}/x"
        raw = await hammer(port, build_request("POST", "/x", {}, "x"), seconds=3)
        print(f"raw keep-alive client, 16 connections: {raw.rps:.0f} calls/s (the mock's ceiling)")
        print("calls/s (CPU µs per call); ratio = CPU per call, aiohttp / ours")
        print("concurrency           aiohttp              ours  ratio")
        for c in (1, 10, 64, 256):
            rows = [await f(url, c) for f in (with_aiohttp, with_ours)]
            cells = "".join(f"  {f'{r.per_s:.0f} ({r.cpu_us:.0f})':>16}" for r in rows)
            print(f"{c:>11}{cells}  {rows[0].cpu_us / rows[1].cpu_us:5.2f}")
    finally:
        stop(mock)


if __name__ == "__main__":
    asyncio.run(main())
