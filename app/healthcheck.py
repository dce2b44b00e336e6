"""`qgw healthcheck`: the container health check (Dockerfile, compose.yaml).

HTTP roles (serve, api, mock-upstream) are checked with a GET. A dispatcher has no port: while
its Redis answers, it touches a heartbeat file in the data directory every second (`beat`),
and the check fails once that file is older than `--max-age`: the process is gone, hung, or
cut off from Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.settings import Settings

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
HEARTBEAT_FILE = "dispatcher.heartbeat"


def heartbeat_path(settings: Settings) -> Path:
    return settings.data_dir / HEARTBEAT_FILE


async def beat(redis: Redis, path: Path,
               announce: Callable[[], Awaitable[object]] | None = None) -> None:
    """Touch `path` every HEARTBEAT_S while Redis answers (runs beside a dispatcher);
    `announce` writes the dispatcher's heartbeat to Redis, in place of a PING."""
    failing = False
    while True:
        try:
            await (announce() if announce else redis.ping())
            _touch(path)
            failing = False
        except (RedisError, OSError) as exc:
            if not failing:  # once an outage, not once a second
                log.warning("no heartbeat: %s", exc)
            failing = True
        await asyncio.sleep(HEARTBEAT_S)


def _touch(path: Path) -> None:
    """A local file's mtime: microseconds, not worth a thread."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def add_parser(sub: Any) -> None:
    doc = "exit 0 when this container's process is healthy (the image's HEALTHCHECK)"
    hc = sub.add_parser("healthcheck", help=doc, description=doc)
    hc.add_argument("--role", choices=("http", "dispatcher"), default="http",
                    help="http: GET a URL; dispatcher: its heartbeat file is fresh (default: http)")
    hc.add_argument("--url", help="http: what to GET (default: /healthz on QGW_HOST:QGW_PORT)")
    hc.add_argument("--max-age", type=float, default=10.0, metavar="SECONDS",
                    help="dispatcher: the oldest heartbeat that counts, in seconds (default: "
                         "%(default)s)")
    hc.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> None:
    problem = (_stale(heartbeat_path(settings), args.max_age) if args.role == "dispatcher"
               else _down(args.url or _healthz(settings)))
    if problem:
        print(f"qgw healthcheck: {problem}", file=sys.stderr)
        sys.exit(1)
    print("healthy")


def _healthz(settings: Settings) -> str:
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}/healthz"


def _down(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return None if r.status == 200 else f"{url} answered {r.status}"
    except OSError as exc:  # URLError, HTTPError and timeouts are all OSErrors
        return f"{url}: {exc}"


def _stale(path: Path, max_age_s: float) -> str | None:
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return f"no heartbeat yet ({path})"
    return None if age <= max_age_s else f"last heartbeat {age:.0f} s ago ({path})"
