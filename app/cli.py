"""`qgw`: serve, api, dispatcher, migrate, mock-upstream, and admin from the shell
(app/admin_cli.py).

A command is a subparser whose defaults carry `run(settings, args)`; add one in `build_parser`.
Heavy modules (uvicorn, the runtime, alembic) are imported by the commands that use them, so
`qgw --help` and the admin commands start quickly. Two commands start with nothing but their
own parser and modules (LIGHT): `mock-upstream`, which needs no settings, no SQL and no Redis
client (0.2 s of CPU a start instead of 0.8: the test suite starts one for a hundred tests),
and `healthcheck`, which a container runs every few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from app import __version__, logs, tracing
from app.embedded import EmbeddedRedisError
from app.startup import Refused, bind, hide_password, migrate_db, prepare_db, start_runtime

if TYPE_CHECKING:
    from app.settings import Settings

Run = Callable[["Settings", argparse.Namespace], None]
log = logging.getLogger("qgw")
MOCK = "mock-upstream"
LIGHT = (MOCK, "healthcheck")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=argv[0] if argv and argv[0] in LIGHT else None).parse_args(argv)
    if args.run is _mock:  # it reads no settings: a stray QGW_* value cannot stop a demo
        logs.setup("info")
        _run(lambda: _mock(None, args))
        return
    from app.settings import SettingsError, load_settings

    overrides = {k: getattr(args, k) for k in getattr(args, "settings_flags", ())
                 if getattr(args, k) is not None}
    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        print(f"qgw: {exc}", file=sys.stderr)
        sys.exit(2)
    level = settings.log_level
    quiet = getattr(args, "quiet", False) and level != "debug"
    if quiet:
        level = "warning"  # a shell command prints its answer; progress lines are noise there
    logs.setup(level)
    if quiet:
        # A one-shot command's loop ends while a background read (the registry's reconcile)
        # may still hold a connection: its reset, cancelled on the way out, loses nothing.
        logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
    _run(lambda: args.run(settings, args))


def _run(command: Callable[[], None]) -> None:
    _raise_open_files_limit()
    try:
        command()
    except Refused as exc:
        print(f"qgw: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except EmbeddedRedisError as exc:
        print(f"qgw: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        # Imported only now: the mock upstream loads no settings module at all.
        from app.settings import SettingsError

        if not isinstance(exc, SettingsError):
            raise
        print(f"qgw: {exc}", file=sys.stderr)  # one found when first used (a key file)
        sys.exit(2)


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


class Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line (which argument, why), not the usage block
    repeated above it: `--help` shows that."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; `only` one of LIGHT: that command's alone (the others' modules
    are not even imported)."""
    p = Parser(
        prog="qgw", description="queue-gateway: a queueing gateway for slow, rate-limited APIs.",
        epilog="Settings come from QGW_* environment variables or a .env file "
               "(docs/reference/settings.md).")
    p.add_argument("--version", action="version", version=f"qgw {__version__}")
    sub = p.add_subparsers(title="commands", metavar="<command>", required=True)
    if only == MOCK:
        _add_mock(sub)
        return p
    if only == "healthcheck":
        from app import healthcheck

        healthcheck.add_parser(sub)
        return p
    from app import admin_cli, healthcheck

    for name, run, doc in (
        ("serve", _serve, "API + dispatcher + reaper + janitor in one process"),
        ("api", _api, "the HTTP API only (scale it apart from the dispatchers)"),
    ):
        sp = sub.add_parser(name, help=doc, description=doc)
        sp.add_argument("--host", help="listen address (default: QGW_HOST, else 127.0.0.1)")
        sp.add_argument("--port", type=int, help="listen port (default: QGW_PORT, else 8080)")
        sp.set_defaults(run=run, settings_flags=("host", "port"))
    command(sub, "dispatcher", _dispatcher,
            "dispatcher + reaper + janitor only: calls the business APIs")
    command(sub, "migrate", _migrate, "bring the database (QGW_DATABASE_URL) to the newest schema")
    _add_mock(sub)
    admin_cli.add_parsers(sub)
    healthcheck.add_parser(sub)
    return p


def _add_mock(sub: Any) -> None:
    mock = command(sub, MOCK, _mock,
                   "a slow business API for tests and demos; answers 429 past --concurrency")
    mock.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    mock.add_argument("--port", type=int, default=9000, help="listen port (default: %(default)s)")
    mock.add_argument("--concurrency", type=int, default=0, metavar="C",
                      help="requests in flight before it answers 429 (default: 0 = unlimited)")
    mock.add_argument("--latency-ms", type=float, default=0, metavar="T",
                      help="how long each answer takes (default: %(default)s)")
    mock.add_argument("--fail-rate", type=float, default=0, metavar="F",
                      help="share of requests answered 503, 0..1 (default: %(default)s)")
    mock.add_argument("--openai", action="store_true",
                      help="answer /v1/chat/completions (JSON and streamed) and /v1/embeddings "
                           "in the OpenAI wire format (default: off)")
    mock.add_argument("--chunks", type=int, default=5, metavar="N",
                      help="events of a streamed chat completion (default: %(default)s)")
    mock.add_argument("--chunk-ms", type=float, default=0, metavar="T",
                      help="pause before each of a stream's events (default: %(default)s)")


def command(sub: Any, name: str, run: Run, doc: str) -> argparse.ArgumentParser:
    """A subcommand with its one-line help (shown in `qgw --help`) and what it runs."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=doc, description=doc)
    parser.set_defaults(run=run)
    return parser


def _serve(settings: Settings, args: argparse.Namespace, dispatcher: bool = True) -> None:
    sock = bind(settings.host, settings.port)  # first: a port in use is all there is to say
    prepare_db(settings)
    tracing.setup("serve" if dispatcher else "api")  # OTEL_* set: spans (app/tracing.py)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_serve_until_stopped(settings, sock, dispatcher))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed, as uvicorn's "auto" would pick: the runtime starts on it before
    uvicorn serves (so `qgw serve` can wait for Redis first), and the dispatcher runs on it
    (its socket writes cost less there)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve_until_stopped(settings: Settings, sock: Any, dispatcher: bool) -> None:
    import uvicorn

    from app.connections import uvicorn_limit
    from app.main import create_app
    from app.sending import SendDeadline

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ours until uvicorn takes the signals over (and gives them back, re-raising the one that
    # stopped it, which then only sets `stop` again): SIGTERM while Redis is awaited exits.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rt = await start_runtime(settings, dispatcher, stop)
    if rt is None:
        return

    def banner() -> None:
        # The generated token is shown so a fresh install can be used at once; one the
        # operator set is theirs already and stays out of stdout, as do URL passwords.
        token = "(QGW_ADMIN_TOKEN)" if settings.admin_token else settings.admin_secret
        print(f"queue-gateway listening on http://{settings.host}:{settings.port}\n"
              f"  admin token: {token}\n"
              f"  redis: {hide_password(rt.redis_url)}\n"
              f"  database: {hide_password(settings.db_url)}", flush=True)

    # Every answer's writes have their deadline, around the whole app (app/sending.py).
    app = SendDeadline(create_app(rt, manage=False, on_started=banner), settings.send_timeout_s)
    # No `Server: uvicorn` on every answer (nothing to fingerprint the gateway by), and a
    # proxied answer keeps the upstream's own rather than carrying two.
    config = uvicorn.Config(app, log_config=None, server_header=False,
                            access_log=False, timeout_graceful_shutdown=5,
                            limit_concurrency=uvicorn_limit(settings))
    server = uvicorn.Server(config)
    on_signal = server.handle_exit

    def draining(sig: int, frame: Any) -> None:
        # The runtime hears when a signal starts the shutdown: the requests its grace then
        # cuts short are answered as such (app/routes/proxy.py).
        rt.draining = True
        on_signal(sig, frame)

    server.handle_exit = draining  # type: ignore[method-assign]
    try:
        await server.serve(sockets=[sock])
    finally:
        # The requests its grace cut short (cancelled) end before the runtime does: a proxied
        # request still in line withdraws its task, which needs Redis (app/routes/proxy.py).
        if (cut := server.server_state.tasks) and not server.force_exit:  # not on a 2nd signal
            await asyncio.wait(cut, timeout=2 * settings.redis_timeout_s)
        await rt.stop()
        tracing.shutdown()


def _api(settings: Settings, args: argparse.Namespace) -> None:
    _serve(settings, args, dispatcher=False)


def _dispatcher(settings: Settings, args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully; a second signal cuts the grace short.

    Redis being down at start is waited out with back-off, like an outage later on.
    """
    import logging

    from app.runtime import Runtime

    log = logging.getLogger("qgw")

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
        rt = await start_runtime(settings, True, stop)
        if rt is None:
            return
        log.info("dispatcher running")
        await stop.wait()
        log.info("dispatcher stopping", extra={"grace_s": settings.shutdown_grace_s})
        await rt.stop(settings.shutdown_grace_s)
        tracing.shutdown()

    prepare_db(settings)
    tracing.setup("dispatcher")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(run())


def _migrate(settings: Settings, args: argparse.Namespace) -> None:
    migrate_db(settings)
    print(f"database at head: {hide_password(settings.db_url)}")


def _mock(settings: Settings | None, args: argparse.Namespace) -> None:
    import uvicorn

    from app.mock_upstream import MockUpstream

    sock = bind(args.host, args.port, settings_env=False)  # as `serve`: a port in use, one line
    app = MockUpstream(args.concurrency, args.latency_ms, args.fail_rate, args.openai,
                       args.chunks, args.chunk_ms)
    print(f"mock upstream on http://{args.host}:{args.port}", flush=True)
    config = uvicorn.Config(app, log_config=None, access_log=False, backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])
