"""Why the upstream client is aiohttp used directly: calls per second to the mock upstream
(latency 0) at several concurrencies through httpx's own pool, httpx over aiohttp's pool and
aiohttp alone (app/queue/upstream.py), beside a raw keep-alive client (bench/_load.py) as the
ceiling of the mock itself, and the CPU seconds each spends per 1,000 calls (on a 2-core machine
the dispatcher's CPU is what caps its calls per second). Bounded, loopback only."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.queue.upstream import upstream_client
from bench._load import build_request, hammer, spawn
from tests.servers import QGW, free_port, stop, wait_port

CALLS = 1500


@dataclass
class Rate:
    per_s: float
    cpu_ms_per_1000: float


async def rate(client: httpx.AsyncClient | aiohttp.ClientSession, url: str,
               concurrency: int) -> Rate:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            if isinstance(client, httpx.AsyncClient):
                (await client.post(url, content=str(i))).raise_for_status()
            else:
                async with client.post(url, data=str(i)) as resp:
                    resp.raise_for_status()
                    await resp.read()

    async with client:
        start, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(CALLS)))
        spent, cpu = time.monotonic() - start, time.process_time() - cpu
        return Rate(CALLS / spent, cpu / CALLS * 1e6)


def httpx_over_aiohttp(connections: int) -> httpx.AsyncClient:
    transport = AiohttpTransport(client=lambda: aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections)))
    return httpx.AsyncClient(transport=transport)


async def main() -> None:
    port = free_port()
    mock = spawn([*QGW, "mock-upstream", "--port", str(port)])
    try:
        wait_port(port, 30, mock)
        url = f"http://127.0.0.1:{port}/x"
        raw = await hammer(port, build_request("POST", "/x", {}, "x"), seconds=3)
        print(f"raw keep-alive client, 16 connections: {raw.rps:.0f} calls/s (the mock's ceiling)")
        print("calls/s (CPU ms per 1,000 calls); ratio = aiohttp / httpx-pool calls/s")
        print("concurrency        httpx-pool     httpx+aiohttp           aiohttp  ratio")
        for c in (1, 16, 64, 256):
            plain = await rate(httpx.AsyncClient(limits=httpx.Limits(max_connections=c)), url, c)
            both = await rate(httpx_over_aiohttp(c), url, c)
            aio = await rate(upstream_client(c), url, c)
            cells = "".join(f"  {f'{r.per_s:.0f} ({r.cpu_ms_per_1000:.0f})':>16}"
                            for r in (plain, both, aio))
            print(f"{c:>11}{cells}  {aio.per_s / plain.per_s:5.2f}")
    finally:
        stop(mock)


if __name__ == "__main__":
    asyncio.run(main())
