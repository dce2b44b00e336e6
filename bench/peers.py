"""Our queue core beside BullMQ, SAQ and arq on one Redis, in one run.

One redis-server (Debian's 7.0 when installed, else the embedded valkey) on a free loopback
port, no persistence; before each measurement it is flushed. Every round runs each queue in a
fresh process (bench/peers_drivers.py for the Python ones, bench/peers_bullmq.js under node):
N no-op jobs enqueued by CONCURRENCY callers, then a worker of CONCURRENCY times them until all N
are acknowledged. Rounds are interleaved (ours, BullMQ, SAQ, arq, then again); each
column is the median of the rounds.
- ours: TaskQueue.submit (the submit script, no HTTP) / the real Dispatcher with the upstream call
  stubbed (app.queue.dispatcher.call answers 200 at once); no outbox writer (bench/e2e_cpu.py
  measures the whole gateway); on uvloop, as `qgw api` and `qgw dispatcher` run.
- BullMQ 5: Queue.add / Worker, installed with npm into a temp dir (skipped if node is absent).
- SAQ, arq (poll 10 ms): pip-installed into a temp venv (arq pins redis-py < 6). Celery is left
  out: its Redis transport wants redis-py >= 6.1, arq < 6; it would need a third environment.
Redis CPU per task: `INFO cpu` (used_cpu_sys + used_cpu_user) delta over a phase, over N; client
CPU per task: the queue's own process (enqueuer, then worker) over the phase, over N.
"Longest gap" is the longest time between two consecutive acknowledgements (issue target: a
backlog never waits 50 ms for dispatch). Loopback only, bounded: every phase gives up after 120 s.
Usage: python bench/peers.py [--tasks N] [--rounds R] [--concurrency C]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import free_port, stop, wait_port

ROOT = Path(__file__).resolve().parent.parent

BULLMQ = "bullmq@5"
PY_PEERS = ("saq>=0.26", "arq>=0.26", "typing_extensions", "hiredis")  # SAQ imports the
# former without declaring it; our redis-py client has hiredis too
RUN_TIMEOUT_S = 400  # one driver process, both phases and start-up
COLUMNS = ("enqueue_per_s", "process_per_s", "cpu_enq_us", "cpu_proc_us", "client_enq_us",
           "client_proc_us", "max_gap_ms")
LABELS = {"ours": "ours (submit script / Dispatcher)", "bullmq": "BullMQ (Queue.add / Worker)",
          "saq": "SAQ", "arq": "arq (poll 10 ms)", "celery": "Celery (solo)"}


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int, str]:
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin")
    if not binary:
        from app.embedded import server_binary

        binary = server_binary()
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(tmp), "--save", "", "--appendonly", "no", "--loglevel",
                             "warning"], stdout=subprocess.DEVNULL)
    wait_port(port, proc=proc)
    version = redis.Redis(port=port).info("server")["redis_version"]
    return proc, port, f"{Path(binary).name} {version}"


def install_bullmq(tmp: Path) -> list[str] | None:
    """node + the driver beside a fresh `npm install bullmq@5`; None (and why) if impossible."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        print("BullMQ: skipped: node/npm not found (apt-get install nodejs npm)")
        return None
    where = tmp / "bullmq"
    where.mkdir()
    (where / "package.json").write_text('{"private": true}')
    r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", BULLMQ],
                       cwd=where, capture_output=True, text=True, timeout=300)
    if r.returncode:
        print(f"BullMQ: skipped: npm install {BULLMQ} failed: {r.stderr.strip()[-300:]}")
        return None
    shutil.copy(ROOT / "bench" / "peers_bullmq.js", where)
    version = json.loads((where / "node_modules/bullmq/package.json").read_text())["version"]
    print(f"BullMQ {version} installed in {where}")
    return [node, str(where / "peers_bullmq.js")]


def install_python_peers(tmp: Path) -> str | None:
    """A venv of their own for SAQ and arq: arq pins redis-py < 6, the gateway runs on newer."""
    venv = tmp / "peers-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    r = subprocess.run([python, "-m", "pip", "install", "-q", *PY_PEERS], capture_output=True,
                       text=True, timeout=300)
    if r.returncode:
        print(f"SAQ, arq: skipped: pip install failed: {r.stderr.strip()[-300:]}")
        return None
    print(f"{', '.join(PY_PEERS)} installed in {venv}")
    return python


def commands(tmp: Path, port: int) -> dict[str, list[str]]:
    """How to run one round of each queue there is (a line for each one skipped)."""
    driver = [sys.executable, str(ROOT / "bench" / "peers_drivers.py")]
    url = f"redis://127.0.0.1:{port}/0"
    cmds = {"ours": [*driver, "ours", url]}
    node = install_bullmq(tmp)
    if node:
        cmds["bullmq"] = [*node, str(port)]
    print(f"{LABELS['celery']}: skipped: kombu's Redis transport needs redis-py >= 6.1 and arq "
          "< 6: it would need a venv of its own")
    python = install_python_peers(tmp)
    if python:
        for name in ("saq", "arq"):
            cmds[name] = [python, *driver[1:], name, url]
    return cmds


def run_round(name: str, cmd: list[str], n: int, conc: int) -> dict[str, float] | None:
    try:
        r = subprocess.run([*cmd, str(n), str(conc)], capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"{LABELS[name]}: dropped: a round took over {RUN_TIMEOUT_S} s")
        return None
    if r.returncode:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{LABELS[name]}: dropped: {why[:300]}")
        return None
    result: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def measure(port: int, cmds: dict[str, list[str]], n: int, conc: int,
            rounds: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cmds}
    flush = redis.Redis(port=port)
    for i in range(rounds):
        for name in list(cmds):
            flush.flushall()
            res = run_round(name, cmds[name], n, conc)
            if res is None:  # broken here: no use trying again
                del cmds[name], results[name]
                continue
            results[name].append(res)
            print(f"  round {i + 1} {name:7} " + "  ".join(f"{k}={v:.1f}" for k, v in
                                                          res.items()), flush=True)
    flush.close()
    return results


def report(results: dict[str, list[dict[str, float]]], head: str) -> None:
    med = {name: {c: statistics.median(r[c] for r in runs) for c in COLUMNS}
           for name, runs in results.items() if runs}
    base = med.get("bullmq")

    def ratio(name: str, col: str) -> str:
        return f" ({med[name][col] / base[col]:.2f}x)" if base else ""

    print(f"\n{head}")
    print(f"{'':36}| {'enqueue/s':>16} | {'no-op processed/s':>17} | "
          f"{'Redis CPU us/task (enq / proc)':>34} | {'client CPU us/task':>18} | longest gap")
    for name, m in med.items():
        cpu = m["cpu_enq_us"] + m["cpu_proc_us"]
        cpu_ratio = (f" ({cpu / (base['cpu_enq_us'] + base['cpu_proc_us']):.2f}x)"
                     if base else "")
        print(f"{LABELS[name]:36}| {m['enqueue_per_s']:>8.0f}{ratio(name, 'enqueue_per_s'):>8} "
              f"| {m['process_per_s']:>9.0f}{ratio(name, 'process_per_s'):>8} | "
              f"{m['cpu_enq_us']:>6.1f} / {m['cpu_proc_us']:>6.1f} = {cpu:>6.1f}{cpu_ratio:>8}"
              f" | {m['client_enq_us']:>7.1f} / {m['client_proc_us']:>6.1f}"
              f" | {m['max_gap_ms']:>6.1f} ms")
    if "ours" in med:
        targets(med["ours"], base)


def targets(ours: dict[str, float], base: dict[str, float] | None) -> None:
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print("\nIssue targets (ratios to BullMQ in brackets above):")
    if base:
        cpu, bcpu = (m["cpu_enq_us"] + m["cpu_proc_us"] for m in (ours, base))
        print(f"  enqueue >= 1.0x BullMQ Queue.add: "
              f"{verdict(ours['enqueue_per_s'] >= base['enqueue_per_s'])}")
        print(f"  claim + ack >= 1.0x BullMQ Worker: "
              f"{verdict(ours['process_per_s'] >= base['process_per_s'])}")
        print(f"  Redis CPU per task <= BullMQ's: {verdict(cpu <= bcpu)}")
    print(f"  no dispatch pause over 50 ms under a backlog (longest gap between two acks "
          f"{ours['max_gap_ms']:.1f} ms): {verdict(ours['max_gap_ms'] <= 50)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgw-peers-") as tmp:
        proc, port, server = start_redis(Path(tmp))
        try:
            cmds = commands(Path(tmp), port)
            results = measure(port, cmds, a.tasks, a.concurrency, a.rounds)
        finally:
            stop(proc)
    report(results, f"{server}, N = {a.tasks:,} no-op jobs, concurrency {a.concurrency}, "
                    f"median of {a.rounds} interleaved rounds; ratios to BullMQ")


if __name__ == "__main__":
    main()
