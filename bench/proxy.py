"""The drop-in proxy against calling directly and against LiteLLM's proxy, in one run, on one
mock upstream (`qgw mock-upstream --openai`: 20 ms before its answer, then a stream of 50 events).

1. Added latency: streamed chat completions at a fixed rate (open loop: 50 and 200 requests a
   second, `--seconds` each), straight to the mock, through ours (`qgw serve`: API, dispatcher
   and embedded Redis in one process tree) and through LiteLLM's proxy (its `model_list` names the
   mock as an OpenAI-compatible model). Latency is to the stream's last byte (and its first
   event, "ttft"); the table shows each gateway's p50/p99 minus direct's. CPU per request is each
   gateway's process tree's utime + stime over the phase (/proc), divided by its requests.
2. Oversubscription: callers at 3x an upstream limit of 20/s for `--over-seconds`; the mock
   refuses (429) past 20 requests in a clock second. Ours: the endpoint's `rate` 20 per 1000 ms;
   LiteLLM: its deployment's `rpm` 1200. Shows the share of the limit the upstream answered 200
   while the callers came (its log), the upstream's 429s, and the callers' error answers by
   kind and time: a gateway's own `503 wait_exceeded` (ours, when the caller's `--max-wait` s
   would pass: at once, by the line's estimate, or at its end) apart from any other, and before
   the caller's max wait ran out (`early`) or after. The goal counts the other errors early.
LiteLLM runs from a virtualenv of its own (`--litellm`: its `litellm` executable; by default
`pip install 'litellm[proxy]'` from PyPI into a temp venv for the run, its version printed;
`none` leaves it out). The load is loopback only, bounded.
The host's floor is printed first: a round trip between two processes over a socket, when the
one woken has been idle as long as the gap between requests at each rate (on a virtual machine
an idle CPU's wake-up costs far more than the trip itself). A request through ours makes two
such trips more than a direct one (to Redis, and the extra hop of any proxy), each starting
from idle at a low rate: twice that figure is added latency no gateway code removes.
Direct and ours take `--rounds` turns of `--seconds`/rounds at each rate, pooled, so that the
machine's drift during the run falls on both alike.
Usage: python bench/proxy.py [--seconds 10] [--over-seconds 60] [--rounds 3]
       [--litellm install|none|/tmp/ll/bin/litellm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._load import ROOT, spawn
from bench.e2e_cpu import cpu_s
from tests.servers import QGW, free_port, stop, wait_port

ADMIN = "bench-admin-token-0123"
CHAT = {"model": "mock", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
LIMIT_PER_S = 20
RATES = (50, 200)  # requests a second of the latency phases
LITELLM_KEY = "sk-" + "0123456789abcdef" * 4  # it refuses to start without one
LITELLM_AUTH = {"Authorization": f"Bearer {LITELLM_KEY}"}


@dataclass
class Phase:
    latency: list[float] = field(default_factory=list)  # to the last byte, s
    ttft: list[float] = field(default_factory=list)  # to the first data: event, s
    statuses: Counter[int] = field(default_factory=Counter)
    # Each error answer (not a 200) by when it came: before the caller's max wait was out
    # (`early`) or after; the gateway's own 503 wait_exceeded told apart from any other.
    errors: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0
    wall_s: float = 0.0  # from the first request to the last answer

    def add(self, other: Phase) -> None:
        """Another phase's requests pooled into this one."""
        self.latency += other.latency
        self.ttft += other.ttft
        self.statuses.update(other.statuses)
        self.errors.update(other.errors)
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s

    def pct(self, q: float, values: list[float] | None = None) -> float:
        data = sorted(self.latency if values is None else values)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000 if data else float("nan")


async def one(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
              out: Phase, max_wait_s: float = math.inf) -> None:
    started = time.perf_counter()
    try:
        async with http.post(url, json=CHAT, headers=headers) as r:
            first, body = None, b""
            async for piece in r.content.iter_any():
                if first is None:
                    first = time.perf_counter() - started
                if r.status != 200 and len(body) < 4096:
                    body += piece
            out.statuses[r.status] += 1
            if r.status == 200:
                out.latency.append(time.perf_counter() - started)
                out.ttft.append(first or 0.0)
            else:
                out.errors[_kind(r.status, body, time.perf_counter() - started, max_wait_s)] += 1
    except (aiohttp.ClientError, TimeoutError):
        out.statuses[0] += 1
        out.errors[_kind(0, b"", time.perf_counter() - started, max_wait_s)] += 1


def _kind(status: int, body: bytes, took_s: float, max_wait_s: float) -> str:
    """An error answer: the gateway's 503 wait_exceeded (the caller's max wait would pass, or
    has) or another, and whether it came while the caller's max wait still ran."""
    own = status == 503 and b'"wait_exceeded"' in body
    what = "503 wait_exceeded" if own else (f"{status}" if status else "no answer")
    return f"{what} {'early' if took_s < max_wait_s - 0.5 else 'after max wait'}"


async def run_rate(url: str, headers: dict[str, str], rate: float, seconds: float,
                   pid: int | None, timeout_s: float = 30,
                   max_wait_s: float = math.inf) -> Phase:
    """Requests at `rate` a second for `seconds` (open loop), each awaited to its end."""
    out = Phase()
    cpu0 = cpu_s(pid) if pid else 0.0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        start, calls = time.perf_counter(), []
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            calls.append(asyncio.create_task(one(http, url, headers, out, max_wait_s)))
        await asyncio.gather(*calls)
        out.wall_s = time.perf_counter() - start
    out.cpu_s = (cpu_s(pid) - cpu0) if pid else 0.0
    return out


def idle_round_trip_ms(gap_s: float, n: int = 200) -> float:
    """The median round trip of one byte to a child process and back over a socket pair, each
    sent `gap_s` after the last answer (the child idle meanwhile)."""
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # the echo: nothing else, so only the wake-up and the trip are measured
        ours.close()
        while data := theirs.recv(16):
            theirs.sendall(data)
        os._exit(0)
    theirs.close()
    took = []
    try:
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            started = time.perf_counter()
            ours.sendall(b"x")
            ours.recv(16)
            took.append(time.perf_counter() - started)
    finally:
        ours.close()
        os.waitpid(child, 0)
    return statistics.median(took) * 1000


def host_floor() -> str:
    trips = {rate: idle_round_trip_ms(1 / rate) for rate in RATES}
    busy = idle_round_trip_ms(0)
    return ("host: a round trip to a process idle for the gap between requests: "
            + ", ".join(f"{trips[r]:.3f} ms at {r}/s" for r in RATES)
            + f" ({busy:.3f} ms back to back); two more of them per request through a gateway: "
            + ", ".join(f"{2 * trips[r]:.2f} ms at {r}/s" for r in RATES))


async def mock_stats(mock: str) -> dict[str, object]:
    async with httpx.AsyncClient() as http:
        stats: dict[str, object] = (await http.get(f"{mock}/_mock/stats")).json()
        return stats


async def mock_config(mock: str, **settings: object) -> None:
    async with httpx.AsyncClient() as http:
        (await http.post(f"{mock}/_mock/reset")).raise_for_status()
        (await http.post(f"{mock}/_mock/config", json=settings)).raise_for_status()


async def start_ours(mock: str, data: Path, tree: Path = ROOT
                     ) -> tuple[object, int, dict[str, str]]:
    """`qgw serve` from `tree`'s code (another checkout: bench/proxy_ab.py)."""
    port = free_port()
    env = {"QGW_ADMIN_TOKEN": ADMIN, "QGW_DATA_DIR": str(data), "QGW_LOG_LEVEL": "warning"}
    proc = spawn([*QGW, "serve", "--port", str(port)], env, cwd=tree)
    await asyncio.to_thread(wait_port, port, 60.0, proc)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=admin) as http:
        # Two endpoints in front of one mock: their URLs differ (one endpoint a URL) by host name.
        for ep, base, fields in (
                ("llm", mock, {}),
                ("llm20", mock.replace("127.0.0.1", "localhost"),
                 {"rate": LIMIT_PER_S, "interval_ms": 1000})):
            (await http.post("/admin/v1/endpoints", json={
                "id": ep, "target_url": f"{base}/v1", "proxy": True, "max_queue_len": 0,
                **fields})).raise_for_status()
        r = await http.post("/admin/v1/api-keys", json={"user_id": 1})
        r.raise_for_status()
        key = r.json()["key"]
    await asyncio.sleep(1.5)  # the registry reaches every part of the process
    return proc, port, {"Authorization": f"Bearer {key}"}


def install_litellm(where: Path) -> str | None:
    """`pip install 'litellm[proxy]'` into a fresh venv under `where`: its `litellm`, or None
    (and why) when that cannot be done."""
    venv = where / "litellm-venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True)
    python = venv / "bin" / "python"
    if made.returncode == 0:
        made = subprocess.run([str(python), "-m", "pip", "install", "-q", "litellm[proxy]"],
                              capture_output=True, text=True)
    if made.returncode != 0:
        print(f"LiteLLM: skipped: its install failed: {made.stderr.strip()[-300:]}")
        return None
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('litellm'))"], capture_output=True, text=True)
    print(f"LiteLLM {version.stdout.strip()} installed in {venv}", flush=True)
    return str(venv / "bin" / "litellm")


async def start_litellm(exe: str, mock: str, data: Path, rpm: int | None) -> tuple[object, int]:
    port = free_port()
    params: dict[str, object] = {"model": "openai/mock", "api_base": f"{mock}/v1",
                                 "api_key": "sk-mock"}
    if rpm:
        params["rpm"] = rpm
    config = data / f"litellm-{port}.json"  # YAML is a superset of JSON
    config.write_text(json.dumps({"model_list": [{"model_name": "mock",
                                                  "litellm_params": params}],
                                  "general_settings": {"master_key": LITELLM_KEY}}))
    proc = spawn([exe, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                 {"LITELLM_LOG": "ERROR"})
    await asyncio.to_thread(wait_port, port, 180.0, proc)
    return proc, port


async def latency_rows(targets: dict[str, tuple[str, dict[str, str], int | None]],
                       seconds: float, rounds: int, mock: str) -> list[str]:
    """Direct and ours take turns, `rounds` short phases each, pooled: the machine's drift over
    a run (on a shared host, easily 0.3 ms at the median) falls on both alike. A peer runs
    after them, once: its backlog would weigh on the phases that follow it."""
    rows = []
    paired = [n for n in ("direct", "queue-gateway") if n in targets]
    for rate in RATES:
        await quiet(mock)  # the last rate's peer may still work off its backlog
        phases = {name: Phase() for name in targets}
        for name, (url, headers, pid) in targets.items():
            if name in paired:
                await run_rate(url, headers, rate, 2, pid)  # warm-up: connections, caches
        for _ in range(rounds):
            for name in paired:
                url, headers, pid = targets[name]
                phases[name].add(await run_rate(url, headers, rate, seconds / rounds, pid))
        for name, (url, headers, pid) in targets.items():
            if name not in paired:
                await run_rate(url, headers, rate, 2, pid)
                phases[name].add(await run_rate(url, headers, rate, seconds, pid))
        d = phases["direct"]
        for name, p in phases.items():
            n = sum(p.statuses.values())
            cpu = f"{p.cpu_s / n * 1000:.2f}" if name != "direct" and n else "-"
            rows.append(
                f"| {rate}/s | {name} | {p.pct(0.5):.2f} | {p.pct(0.99):.2f} | "
                f"{p.pct(0.5) - d.pct(0.5):+.2f} | {p.pct(0.99) - d.pct(0.99):+.2f} | "
                f"{p.pct(0.5, p.ttft) - d.pct(0.5, d.ttft):+.2f} | {cpu} | "
                f"{dict(p.statuses)} |")
    return rows


async def quiet(mock: str, timeout_s: float = 60) -> None:
    """Until the mock has no call in flight: a gateway still working off an earlier phase's
    backlog (callers that gave up) would spend the next phase's limit, and its 429s count."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s * 2)):
        if not (await mock_stats(mock))["in_flight"] or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.5)


async def over_row(name: str, url: str, headers: dict[str, str], mock: str,
                   seconds: float, max_wait: float) -> str:
    await quiet(mock)
    await mock_config(mock, rate_per_s=LIMIT_PER_S)
    began = time.time() * 1000  # the mock's clock: its log's `t`
    p = await run_rate(url, headers, 3 * LIMIT_PER_S, seconds, None, timeout_s=max_wait + 30,
                       max_wait_s=max_wait)
    stats = await mock_stats(mock)
    upstream_429 = dict(stats["statuses"]).get("429", 0)  # type: ignore[call-overload]
    # What the upstream answered while the callers came: the share of its limit a gateway kept
    # it busy with (calls made later, for callers still in line, are not counted in it).
    async with httpx.AsyncClient() as http:
        log = (await http.get(f"{mock}/_mock/log")).json()
    served = sum(1 for e in log if e["status"] == 200 and began <= e["t"] < began + seconds * 1000)
    share = served / (LIMIT_PER_S * seconds)
    ok = p.statuses.get(200, 0)
    early = sum(v for k, v in p.errors.items() if k.endswith("early")
                and not k.startswith("503 wait_exceeded"))
    errors = ", ".join(f"{v} {k}" for k, v in sorted(p.errors.items())) or "none"
    return f"| {name} | {ok} | {share:.3f} | {upstream_429} | {early} | {errors} |"


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        mport = free_port()
        mock_proc = spawn([*QGW, "mock-upstream", "--openai", "--port", str(mport),
                           "--latency-ms", "20", "--chunks", "50"])
        procs: list[object] = [mock_proc]
        try:
            exe = args.litellm
            if exe == "install":
                exe = await asyncio.to_thread(install_litellm, data)
            elif exe == "none":
                exe = None
            await asyncio.to_thread(wait_port, mport, 30.0, mock_proc)
            mock = f"http://127.0.0.1:{mport}"
            ours, oport, auth = await start_ours(mock, data)
            procs.append(ours)
            targets: dict[str, tuple[str, dict[str, str], int | None]] = {
                "direct": (f"{mock}/v1/chat/completions", {}, None),
                "queue-gateway": (f"http://127.0.0.1:{oport}/proxy/llm/chat/completions", auth,
                                  ours.pid)}  # type: ignore[attr-defined]
            if exe:
                ll, lport = await start_litellm(exe, mock, data, None)
                procs.append(ll)
                targets["litellm"] = (f"http://127.0.0.1:{lport}/v1/chat/completions",
                                      LITELLM_AUTH,
                                      ll.pid)  # type: ignore[attr-defined]
            print(await asyncio.to_thread(host_floor), flush=True)
            print("| rate | target | p50 ms | p99 ms | added p50 | added p99 | added ttft p50 "
                  "| CPU ms/req | answers |\n|---|---|---|---|---|---|---|---|---|")
            for row in await latency_rows(targets, args.seconds, args.rounds, mock):
                print(row, flush=True)
            if exe:  # its backlog of the latency phases must not reach the mock now
                stop(procs.pop())  # type: ignore[arg-type]
            if args.over_seconds <= 0:  # the latency phases only
                return
            print(f"\noversubscription: {3 * LIMIT_PER_S}/s for {args.over_seconds:g} s against "
                  f"{LIMIT_PER_S}/s, callers' max wait {args.max_wait:g} s\n"
                  "| gateway | answered 200 | share of limit | upstream 429s | "
                  "other errors within max wait | error answers |\n|---|---|---|---|---|---|")
            over = {"X-Queue-Max-Wait": str(args.max_wait), **auth}
            print(await over_row("queue-gateway",
                                 f"http://127.0.0.1:{oport}/proxy/llm20/chat/completions", over,
                                 mock, args.over_seconds, args.max_wait), flush=True)
            if exe:
                ll20, l20port = await start_litellm(exe, mock, data, 60 * LIMIT_PER_S)
                procs.append(ll20)
                print(await over_row("litellm", f"http://127.0.0.1:{l20port}/v1/chat/"
                                     "completions", LITELLM_AUTH, mock, args.over_seconds,
                                     args.max_wait),
                      flush=True)
        finally:
            for proc in procs:
                stop(proc)  # type: ignore[arg-type]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--over-seconds", type=float, default=60,
                        help="the oversubscription phase's length; 0 leaves it out")
    parser.add_argument("--max-wait", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns direct and ours take at each rate (their phases pooled)")
    parser.add_argument("--litellm", default=os.environ.get("LITELLM_BIN", "install"),
                        help="its `litellm` executable; `install` (the default): pip-installed "
                        "into a temp venv for the run; `none`: left out")
    parsed = parser.parse_args()
    if parsed.rounds < 1:
        parser.error("--rounds must be 1 or more")
    asyncio.run(main(parsed))
