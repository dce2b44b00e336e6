"""Why the upstream client is httpx over aiohttp: calls per second to the mock upstream
(latency 0) at several concurrencies, httpx's own pool vs the aiohttp transport, beside a raw
keep-alive client (bench/_load.py) as the ceiling of the mock itself. Bounded, loopback only."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.queue.upstream import upstream_client
from bench._load import build_request, hammer, spawn
from tests.servers import QGW, free_port, stop, wait_port

CALLS = 1500


async def rate(client: httpx.AsyncClient, url: str, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            (await client.post(url, content=str(i))).raise_for_status()

    async with client:
        start = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(CALLS)))
        return CALLS / (time.monotonic() - start)


async def main() -> None:
    port = free_port()
    mock = spawn([*QGW, "mock-upstream", "--port", str(port)])
    try:
        wait_port(port, 30, mock)
        url = f"http://127.0.0.1:{port}/x"
        raw = await hammer(port, build_request("POST", "/x", {}, "x"), seconds=3)
        print(f"raw keep-alive client, 16 connections: {raw.rps:.0f} calls/s (the mock's ceiling)")
        print("concurrency  httpx-pool  httpx+aiohttp  ratio")
        for c in (1, 16, 64, 256):
            plain = await rate(httpx.AsyncClient(limits=httpx.Limits(max_connections=c)), url, c)
            aio = await rate(upstream_client(c), url, c)
            print(f"{c:>11}  {plain:>10.0f}  {aio:>13.0f}  {aio / plain:5.2f}")
    finally:
        stop(mock)


if __name__ == "__main__":
    asyncio.run(main())
