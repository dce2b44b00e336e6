"""A Redis Sentinel or Cluster failover under load, with and without QGW_REDIS_WAIT_REPLICAS=1.

Real processes on loopback: 1 master, 1 replica and 3 sentinels, or a Cluster of 3 masters with
a replica each; `qgw serve` on its URL, the mock upstream; six submitters run through a kill -9
of the master (on the Cluster, the one holding the load's queue; tests/failover.py). Two cases:
a healthy replica, and one lagging a second behind (stopped, with more written than the
sockets between them hold) when the master dies.

    .venv/bin/python bench/failover.py [--kind sentinel|cluster|both] [--runs N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.failover import Kind, run_failover


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--kind", choices=("sentinel", "cluster", "both"), default="both")
    args = p.parse_args()
    kinds: list[Kind] = ["sentinel", "cluster"] if args.kind == "both" else [args.kind]
    for kind in kinds:
        for lag_s in (0.0, 1.0):
            for wait in (0, 1):
                for _ in range(args.runs):
                    with tempfile.TemporaryDirectory() as tmp:
                        fig = run_failover(Path(tmp), wait, lag_s=lag_s, kind=kind)
                    case = f"replica lagging {lag_s:.0f} s" if lag_s else "replica in sync"
                    print(f"{case:<22} {fig.line()}", flush=True)


if __name__ == "__main__":
    main()
