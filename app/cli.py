"""`qgw`: serve, api, dispatcher, migrate, mock-upstream, and admin from the shell."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from typing import Any

import uvicorn

from app import admin_cli, healthcheck, logs, migrate
from app.settings import Settings, SettingsError, load_settings

log = logging.getLogger("qgw")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None} \
        if hasattr(args, "host") else {}
    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        print(f"qgw: {exc}", file=sys.stderr)
        sys.exit(2)
    logs.setup(settings.log_level)
    _raise_open_files_limit()
    try:
        args.run(settings, args)
    except KeyboardInterrupt:
        pass


def _raise_open_files_limit() -> None:
    """Up to the hard limit, as Go programs do at start: every client connection and upstream
    call holds a descriptor, and at the common soft limit of 1024 a thousand idle or slow
    clients made the server refuse new ones (accept failed) until they went away."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qgw", description="queue-gateway")
    sub = p.add_subparsers(required=True, metavar="command")

    for name, run, doc in (
        ("serve", _serve, "API + dispatcher + reaper in one process"),
        ("api", _api, "the HTTP API only"),
    ):
        sp = sub.add_parser(name, help=doc)
        sp.add_argument("--host")
        sp.add_argument("--port", type=int)
        sp.set_defaults(run=run)
    sub.add_parser("dispatcher", help="dispatcher + reaper only").set_defaults(run=_dispatcher)
    sub.add_parser("migrate", help="run database migrations").set_defaults(run=_migrate)

    mock = sub.add_parser("mock-upstream", help="a slow business API for tests and demos")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=9000)
    mock.add_argument("--concurrency", type=int, default=0)
    mock.add_argument("--latency-ms", type=float, default=0)
    mock.add_argument("--fail-rate", type=float, default=0)
    mock.set_defaults(run=_mock)
    admin_cli.add_parsers(sub)
    healthcheck.add_parser(sub)
    return p


def prepare_db(settings: Settings) -> None:
    """Migrate on start (the default): one command takes a fresh machine to a running gateway."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.auto_migrate:
        _migrate(settings, None, quiet=True)
        return
    try:
        behind = migrate.pending(settings.db_url)
    except Exception as exc:  # whatever the driver raises, the operator gets one line
        behind = _one_line(exc)
    if behind:  # QGW_AUTO_MIGRATE=false: refuse rather than fail later on a missing table
        print(f"qgw: {behind}; run `qgw migrate` (database {_hide_password(settings.db_url)})",
              file=sys.stderr)
        sys.exit(1)


def _serve(settings: Settings, args: Any, dispatcher: bool = True) -> None:
    from app.main import create_app
    from app.runtime import Runtime

    prepare_db(settings)
    runtime = Runtime(settings, with_dispatcher=dispatcher)

    def banner() -> None:
        # The generated token is shown so a fresh install can be used at once; one the
        # operator set is theirs already and stays out of stdout, as do URL passwords.
        token = "(QGW_ADMIN_TOKEN)" if settings.admin_token else settings.admin_secret
        print(f"queue-gateway listening on http://{settings.host}:{settings.port}\n"
              f"  admin token: {token}\n"
              f"  redis: {_hide_password(runtime.redis_url)}\n"
              f"  database: {_hide_password(settings.db_url)}", flush=True)

    app = create_app(runtime, on_started=banner)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None,
                access_log=False, timeout_graceful_shutdown=5)


def _hide_password(url: str) -> str:
    """`scheme://user:***@host/...`: the URL as an operator needs to see it, minus the secret."""
    return re.sub(r"^([a-z0-9+.-]+://[^:/@]*):[^/]*@", r"\1:***@", url)


def _api(settings: Settings, args: Any) -> None:
    _serve(settings, args, dispatcher=False)


def _dispatcher(settings: Settings, args: Any) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully; a second signal cuts the grace short.

    Redis being down at start is waited out with back-off, like an outage later on.
    """
    import contextlib

    from redis.exceptions import RedisError

    from app.runtime import Runtime

    async def start(stop: asyncio.Event) -> Runtime | None:
        tries = 0
        while not stop.is_set():
            tries += 1
            rt = Runtime(settings, with_dispatcher=True)
            try:
                await rt.start()
                return rt
            except (RedisError, OSError) as exc:
                with contextlib.suppress(Exception):
                    await rt.stop(0)
                delay = min(0.2 * 2 ** min(tries - 1, 4), 2.0)
                log.warning("cannot start (%s); retrying in %.1f s", exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return None

    async def run() -> None:
        stop = asyncio.Event()
        rt: Runtime | None = None

        def on_signal() -> None:
            if stop.is_set() and rt is not None and rt.dispatcher is not None:
                rt.dispatcher.hurry()
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        rt = await start(stop)
        if rt is None:
            return
        log.info("dispatcher running")
        await stop.wait()
        log.info("dispatcher stopping", extra={"grace_s": settings.shutdown_grace_s})
        await rt.stop(settings.shutdown_grace_s)

    prepare_db(settings)
    asyncio.run(run())


def _migrate(settings: Settings, args: Any, quiet: bool = False) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        migrate.upgrade(settings.db_url)
    except Exception as exc:  # whatever the driver raises, the operator gets one line
        print(f"qgw: cannot migrate {_hide_password(settings.db_url)}: {_one_line(exc)}",
              file=sys.stderr)
        sys.exit(1)
    if not quiet:
        print(f"database at head: {_hide_password(settings.db_url)}")


def _one_line(exc: BaseException) -> str:
    """An error for a one-line message: drivers' messages run over several lines."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def _mock(settings: Settings, args: Any) -> None:
    from app.mock_upstream import MockUpstream

    app = MockUpstream(args.concurrency, args.latency_ms, args.fail_rate)
    print(f"mock upstream on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                backlog=4096)
