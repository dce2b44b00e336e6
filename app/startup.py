"""What every `qgw` command needs before it can work (the database, Redis, a port), and one
line naming the cause and the fix when it cannot have it.

Shared by app/cli.py (processes) and app/admin_cli.py (admin from the shell); it imports
neither, and nothing heavy at import time, so `qgw --help` stays quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.runtime import Runtime
    from app.settings import Settings

log = logging.getLogger("qgw")


class Refused(Exception):
    """The command cannot go on; `str(exc)` is the one line the operator sees."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def hide_password(url: str) -> str:
    """`scheme://user:***@host/...`: the URL as an operator needs to see it, minus the secret."""
    return re.sub(r"^([a-z0-9+.-]+://[^:/@]*):[^/]*@", r"\1:***@", url)


def one_line(exc: BaseException) -> str:
    """An error for a one-line message: drivers' messages run over several lines, and some
    (redis-py's Sentinel: "No master found for 'x' : {<every connection's repr>}") carry
    their clients' state after the sentence."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if type(exc).__name__ == "MasterNotFoundError":
        first = first.partition(" : ")[0] + " (is the service name in the URL right?)"
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(exc).__name__}: {first}"


def migrate_db(settings: Settings) -> None:
    from app import migrate

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        migrate.upgrade(settings.db_url)
    except Exception as exc:  # whatever the driver raises, the operator gets one line
        raise Refused(f"cannot migrate {hide_password(settings.db_url)}: {one_line(exc)}") \
            from None


def prepare_db(settings: Settings) -> None:
    """Migrate on start (the default): one command takes a fresh machine to a running gateway."""
    from app import migrate

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.auto_migrate:
        migrate_db(settings)
        return
    try:
        behind = migrate.pending(settings.db_url)
    except Exception as exc:  # whatever the driver raises, the operator gets one line
        behind = one_line(exc)
    if behind:  # QGW_AUTO_MIGRATE=false: refuse rather than fail later on a missing table
        raise Refused(f"{behind}; run `qgw migrate` (database {hide_password(settings.db_url)})")


def require_db(settings: Settings) -> None:
    """Admin commands work on the gateway's database: run in another directory, the default
    `./.qgw` would be a new, empty one, and `list` would answer `[]` as if that were true."""
    if settings.database_url:
        return
    path = settings.data_dir.resolve() / "qgw.db"
    if not path.exists():
        raise Refused(f"no database at {path}: run this where `qgw serve` runs, or set "
                      "QGW_DATA_DIR (or QGW_DATABASE_URL) to the gateway's data dir (or database)")


def bind(host: str, port: int, settings_env: bool = True) -> socket.socket:
    """The listening socket, bound before anything starts, so a port in use is the first and
    only thing said (uvicorn binds after the app has started and announced itself).
    `settings_env`: the fix names QGW_HOST / QGW_PORT besides the options."""
    host_fix, port_fix = ("--host / QGW_HOST", "--port / QGW_PORT") if settings_env \
        else ("--host", "--port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise Refused(f"cannot listen on {host}:{port}: {exc}; check {host_fix}") \
            from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = (f"the port is in use by another process; stop it or choose another with "
               f"{port_fix}") if exc.errno == errno.EADDRINUSE else f"{exc.strerror}"
        raise Refused(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


async def start_runtime(
    settings: Settings, with_dispatcher: bool, stop: asyncio.Event
) -> Runtime | None:
    """A started runtime; Redis down is waited out with back-off and a warning a try, like an
    outage later on. None if `stop` is set first."""
    from redis.exceptions import RedisError

    from app.redis_url import WrongKind
    from app.runtime import Runtime

    tries = 0
    while not stop.is_set():
        tries += 1
        rt = Runtime(settings, with_dispatcher=with_dispatcher)
        try:
            await rt.start()
            return rt
        except WrongKind as exc:
            with contextlib.suppress(Exception):
                await rt.stop(0)
            raise Refused(str(exc)) from None
        except (RedisError, OSError) as exc:
            with contextlib.suppress(Exception):
                await rt.stop(0)
            delay = min(0.2 * 2 ** min(tries - 1, 4), 2.0)
            log.warning("cannot reach Redis (%s); retrying in %.1f s", one_line(exc), delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return None
