"""What a change did to the drop-in proxy's added latency: this tree's gateway against another
checkout's (`--base`, e.g. `git worktree add /tmp/base HEAD~3`), both in front of one mock
upstream (`qgw mock-upstream --openai`, no delay, a stream of 50 events), measured in the same
run, request by request.

A lone figure of the proxy's added latency moves by tenths of a millisecond between runs on a
shared machine (bench/proxy.py), more than most changes do. Here each round sends one request
straight to the mock and one through each gateway, in a rotating order, one at a time (a closed
loop, a few ms apart), and takes the median of the paired differences (this tree's latency
minus the base's, same round). Two gateways side by side are not placed alike (which started
second, whose Redis the kernel favours), so the run is made twice with their places swapped:
half the difference of the two medians is the change's effect, half their sum the placement's,
which cancels. Also printed: each one's added p50 over direct, and its CPU a request.

Usage: python bench/proxy_ab.py --base /tmp/base [--rounds 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import ROOT, spawn
from bench.e2e_cpu import cpu_s
from bench.proxy import CHAT, mock_config, start_ours
from tests.servers import QGW, free_port, stop, wait_port

GAP_S = 0.003  # between requests: each meets the machine as a lone caller does


async def one(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with http.post(url, json=CHAT, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status}")
    return time.perf_counter() - started


async def paired(first: Path, second: Path, rounds: int) -> tuple[float, dict[Path, str]]:
    """One run, `first` started first: the median of (second - first) over rounds (ms), and
    each tree's added p50 and CPU a request."""
    mport = free_port()
    mock_proc = spawn([*QGW, "mock-upstream", "--openai", "--port", str(mport), "--chunks", "50"])
    procs: list[object] = [mock_proc]
    # The gateways (their embedded Redis among them) stop before their data directory goes.
    with tempfile.TemporaryDirectory() as tmp:
        try:
            await asyncio.to_thread(wait_port, mport, 30.0, mock_proc)
            mock = f"http://127.0.0.1:{mport}"
            await mock_config(mock, latency_ms=0)
            targets: list[tuple[str, dict[str, str], int | None]] = [
                (f"{mock}/v1/chat/completions", {}, None)]
            for i, tree in enumerate((first, second)):
                proc, port, auth = await start_ours(mock, Path(tmp) / str(i), tree)
                procs.append(proc)
                targets.append((f"http://127.0.0.1:{port}/proxy/llm/chat/completions", auth,
                                proc.pid))  # type: ignore[attr-defined]
            times: list[list[float]] = [[], [], []]
            async with aiohttp.ClientSession() as http:
                for _ in range(100):  # warm: connections, caches, the gateways' first claims
                    for url, headers, _pid in targets:
                        await one(http, url, headers)
                cpu0 = [cpu_s(pid) if pid else 0.0 for _, _, pid in targets]
                for r in range(rounds):
                    for j in ((r + k) % 3 for k in range(3)):
                        url, headers, _pid = targets[j]
                        times[j].append(await one(http, url, headers))
                        await asyncio.sleep(GAP_S)
                cpu = [(cpu_s(pid) - c0) / rounds * 1000 if pid else 0.0
                       for (_, _, pid), c0 in zip(targets, cpu0, strict=True)]
        finally:
            for proc in procs:
                stop(proc)  # type: ignore[arg-type]
    direct = statistics.median(times[0])
    diff = statistics.median(b - a for a, b in zip(times[1], times[2], strict=True)) * 1000
    return diff, {tree: f"added p50 {(statistics.median(times[k]) - direct) * 1000:+.3f} ms, "
                        f"{cpu[k]:.2f} ms CPU a request"
                  for k, tree in ((1, first), (2, second))}


async def main(base: Path, rounds: int) -> None:
    here = ROOT
    d1, seen1 = await paired(base, here, rounds)  # (here - base) + placement
    d2, seen2 = await paired(here, base, rounds)  # (base - here) + placement
    for label, seen in (("base started first", seen1), ("this tree started first", seen2)):
        print(f"{label}: this tree {seen[here]}; base {seen[base]}")
    print(f"this tree minus base, paired median: {(d1 - d2) / 2:+.3f} ms "
          f"(placement: {(d1 + d2) / 2:+.3f} ms; {rounds} rounds a run)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="another checkout of this repository")
    parser.add_argument("--rounds", type=int, default=2000)
    parsed = parser.parse_args()
    asyncio.run(main(Path(parsed.base).resolve(), parsed.rounds))
