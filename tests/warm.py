"""Warm starts of `qgw` for the tests: `python -m app ...` forked from a process that has
imported the gateway's libraries already, instead of a new interpreter importing them again.

Why: a suite run starts some 450 `qgw` processes (api, dispatcher, serve, migrate, the CLI),
and each spent ~1.1 s of CPU importing SQLAlchemy, FastAPI, pydantic, redis-py and uvicorn
before it ran a line of its own: about a third of the suite's CPU on a two-core machine.

How: each pytest worker starts one fork server (`python -m tests.warm <fd>`, before it has
any threads or event loop of its own). It imports those libraries, nothing of `app` (whose
modules read their settings and environment when imported: each child imports them afresh,
as a new interpreter would), and forks a child per request. The child takes the request's
stdin, stdout and stderr, working directory, environment and session, then runs the `app`
module as `python -m app` would, and exits with its code. What the test holds is a real
`subprocess.Popen` (`install` adds the warm way to the class): its pid is the child's, so
signals (a SIGKILL to stop a process dead) reach the gateway itself; only waiting for it goes
through the fork server, the child's parent, which reports its exit status on a pipe.

A command the fork server cannot reproduce exactly starts the usual way: a shell, its own
executable, pass_fds, a preexec_fn, another user, or an environment that differs from the
server's in what an interpreter's start fixes (PYTHON* settings, locale, time zone, what
the libraries read when imported). Should the server die, a child still running is not
taken for ended: its end is watched through a pidfd (its exit code is lost, 255).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

#: What a `qgw` command starts with in the tests (tests/servers.py QGW is this).
PREFIX = [sys.executable, "-m", "app"]
#: The libraries `qgw` imports: the fork server's children find them loaded.
LIBRARIES = (
    "sqlalchemy.ext.asyncio", "sqlalchemy.orm", "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.mysql", "aiosqlite", "aiomysql", "pymysql", "alembic.command",
    "alembic.config", "alembic.runtime.migration", "fastapi", "fastapi.routing",
    "fastapi.responses", "starlette.applications", "starlette.middleware",
    "pydantic", "pydantic_settings", "redis.asyncio", "redis.asyncio.cluster",
    "redis.asyncio.sentinel", "hiredis", "uvicorn", "uvicorn.config", "uvicorn.server",
    "uvicorn.protocols.http.httptools_impl", "uvicorn.lifespan.on", "uvloop", "httptools",
    "prometheus_client", "argparse", "asyncio", "json", "logging.config",
)
#: Environment the fork server's own start fixed (the interpreter's PYTHON* settings, the
#: locale, the time zone; what the libraries above read when imported): a command whose
#: environment differs from the server's in any of these starts cold. The child sets these
#: two PYTHON* itself.
_CHILD_SETS = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
_FIXED = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "OTEL_PROPAGATORS", "OTEL_PYTHON_CONTEXT",
          "PROMETHEUS_DISABLE_CREATED_SERIES", "PROMETHEUS_MULTIPROC_DIR")

_server: subprocess.Popen[bytes] | None = None
_server_env: dict[str, str] = {}
_control: socket.socket | None = None
_lock = threading.Lock()


def install() -> None:
    """Start this process's fork server and give `subprocess.Popen` its warm way for `qgw`
    commands. Call before any thread or event loop (the server is a plain fork/exec)."""
    global _server, _control, _server_env
    if _server is not None or not _fits():
        return
    _server_env = _fixed(os.environ)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _server = subprocess.Popen([sys.executable, "-m", "tests.warm", str(theirs.fileno())],
                          pass_fds=[theirs.fileno()], cwd=root, stdin=subprocess.DEVNULL)
    theirs.close()
    _control = ours
    # Waiting is told apart by the instance (a warm child has a status pipe), and stays.
    for name, method in _WARM.items():
        setattr(subprocess.Popen, name, method)


def _fits() -> bool:
    """Whether this Python's Popen has the private ways this replaces, as written for."""
    import inspect

    try:
        params = list(inspect.signature(_COLD[_EXECUTE]).parameters)
    except (KeyError, TypeError, ValueError):
        return False
    return params == _EXECUTE_PARAMS and _POLL in _COLD and _TRY_WAIT in _COLD


def uninstall() -> None:
    """Let the fork server go; `qgw` starts cold again."""
    global _server
    _unpatch()
    if _server is not None:
        # It goes once the last of its children has (one a test left running keeps it),
        # telling each one's end: never killed, which would leave them untold.
        with contextlib.suppress(subprocess.TimeoutExpired):
            _server.wait(1)
        _server = None


def _unpatch() -> None:
    """Cold starts from now on (warm children already started still report their ends)."""
    global _control
    setattr(subprocess.Popen, _EXECUTE, _COLD[_EXECUTE])
    if _control is not None:
        _control.close()  # the server exits at its end of file
        _control = None


# -- the test's side: subprocess.Popen's warm way ------------------------------------------

#: Popen's own ways (the private methods of CPython 3.11's POSIX Popen this replaces).
_EXECUTE, _POLL, _TRY_WAIT = "_execute_child", "_internal_poll", "_try_wait"
_COLD: dict[str, Any] = {name: getattr(subprocess.Popen, name)
                         for name in (_EXECUTE, _POLL, _TRY_WAIT)
                         if hasattr(subprocess.Popen, name)}
_EXECUTE_PARAMS = [
    "self", "args", "executable", "preexec_fn", "close_fds", "pass_fds", "cwd", "env",
    "startupinfo", "creationflags", "shell", "p2cread", "p2cwrite", "c2pread", "c2pwrite",
    "errread", "errwrite", "restore_signals", "gid", "gids", "uid", "umask",
    "start_new_session", "process_group"]
_PIPES = ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")


def _warm(p: dict[str, Any]) -> bool:
    """Whether the fork server can start this command (`p`: `_execute_child`'s parameters)
    exactly as a new interpreter would."""
    if _control is None or p["shell"] or p["executable"] is not None:
        return False
    if p["preexec_fn"] is not None or p["pass_fds"] or p["umask"] >= 0:
        return False
    if any(p[k] is not None for k in ("gid", "gids", "uid")) or p["process_group"] not in (
            None, -1):
        return False
    args, cwd = p["args"], p["cwd"]
    if not isinstance(args, list | tuple) or list(args[:3]) != PREFIX:
        return False
    if not all(isinstance(a, str) for a in args) or (cwd is not None and not os.path.isdir(cwd)):
        return False  # a missing cwd: the usual way raises for it
    environ = os.environ if p["env"] is None else p["env"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in environ.items()):
        return False  # as given to a new interpreter: bytes, or an error of the test's
    return _fixed(environ) == _server_env


def _fixed(environ: Any) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k in _FIXED
            or (k.startswith("PYTHON") and k not in _CHILD_SETS)}


def _execute_child(self: subprocess.Popen[Any], *params: Any) -> None:
    """Popen's own, its positional parameters the same (`_EXECUTE_PARAMS`): a `qgw` command
    the fork server can start is forked there, any other started the usual way."""
    p = dict(zip(_EXECUTE_PARAMS[1:], params, strict=True))
    if not _warm(p):
        _COLD[_EXECUTE](self, *params)
        return
    cwd = p["cwd"]
    request = json.dumps({
        "argv": list(p["args"][3:]), "env": dict(os.environ if p["env"] is None else p["env"]),
        "cwd": os.path.abspath(os.fsdecode(cwd) if cwd is not None else "."),
        "session": bool(p["start_new_session"]),
    }).encode()
    status_r, status_w = os.pipe()
    # The child's stdin, stdout, stderr (this process's own where the Popen gave none)
    fds = [p["p2cread"], p["c2pwrite"], p["errwrite"]]
    fds = [fd if fd != -1 else own for own, fd in enumerate(fds)] + [status_w]
    assert _control is not None
    try:
        with _lock:
            message = len(request).to_bytes(4, "big") + request
            sent = socket.send_fds(_control, [message], fds)  # the fds go with its first bytes
            _control.sendall(message[sent:])
            reply = _read_exactly(_control, 8)
    except OSError:  # the fork server is gone: this one and the rest start cold
        _unpatch()
        os.close(status_r)
        _COLD[_EXECUTE](self, *params)
        return
    finally:
        os.close(status_w)
    pid = int.from_bytes(reply, "big", signed=True)
    if pid <= 0:
        os.close(status_r)
        raise OSError(-pid, f"the fork server could not start {p['args']!r}: "
                      f"{os.strerror(-pid)}")
    self.pid = pid
    self._warm_status = status_r  # type: ignore[attr-defined]
    # Its own end, should the fork server be gone before telling it (its status is lost then)
    self._warm_pidfd = os.pidfd_open(pid)  # type: ignore[attr-defined]
    self._child_created = True  # type: ignore[attr-defined]
    self._close_pipe_fds(*(p[k] for k in _PIPES))  # type: ignore[attr-defined]


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise OSError("the fork server is gone")
        data += part
    return data


def _try_wait(self: subprocess.Popen[Any], wait_flags: int) -> tuple[int, int]:
    status_r = getattr(self, "_warm_status", None)
    if status_r is None:
        return _COLD[_TRY_WAIT](self, wait_flags)  # type: ignore[no-any-return]
    block = not wait_flags & os.WNOHANG
    if not _ready(status_r, block):
        return 0, 0
    data = b""
    while len(data) < 4:
        part = os.read(status_r, 4 - len(data))
        if not part:
            break
        data += part
    pidfd: int = self._warm_pidfd  # type: ignore[attr-defined]
    if len(data) == 4:
        status = int.from_bytes(data, "big")
    elif _ready(pidfd, block):  # the server is gone and so is the child: its code is lost
        status = UNKNOWN_STATUS
    else:  # the server is gone, the child runs on
        return 0, 0
    os.close(status_r)
    os.close(pidfd)
    self._warm_status = None  # type: ignore[attr-defined]
    return self.pid, status


#: The wait status reported for a child whose fork server died before telling its own (255).
UNKNOWN_STATUS = 255 << 8


def _ready(fd: int, block: bool) -> bool:
    poller = select.poll()  # not select(): a worker may hold more than 1024 descriptors
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if block else 0))


def _internal_poll(self: subprocess.Popen[Any], _deadstate: Any = None, **kwargs: Any
                   ) -> int | None:
    if getattr(self, "_warm_status", None) is None:
        return _COLD[_POLL](self, _deadstate, **kwargs)  # type: ignore[no-any-return]
    if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
        try:
            if self.returncode is None:
                pid, sts = _try_wait(self, os.WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(sts)  # type: ignore[attr-defined]
        finally:
            self._waitpid_lock.release()  # type: ignore[attr-defined]
    return self.returncode


_WARM = {_EXECUTE: _execute_child, _POLL: _internal_poll, _TRY_WAIT: _try_wait}


# -- the fork server ------------------------------------------------------------------------

def _serve(control: socket.socket) -> None:
    """Fork a child per request; tell each child's status pipe its wait status when it ends."""
    for name in LIBRARIES:
        __import__(name)
    import gc

    gc.freeze()  # what is loaded now is shared with the children, not copied by their GC
    # A Ctrl-C reaches the whole process group: the server stays until the tests' process has
    # gone and its children have; each child takes SIGINT back as a new interpreter has it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, int] = {}  # pid -> its status pipe
    listening = True
    while listening or children:  # after the tests' end, until the last child's end is told
        ready = select.select([control.fileno(), wake_r] if listening else [wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(children)
        if control.fileno() not in ready:
            continue
        # The descriptors come with the message's first bytes (one request at a time).
        msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        if not msg:
            listening = False  # the tests' process is done
            continue
        size = int.from_bytes(msg[:4], "big")
        while len(msg) < 4 + size:
            msg += _read_exactly(control, 4 + size - len(msg))
        request = json.loads(msg[4:])
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            control.sendall((-(exc.errno or 1)).to_bytes(8, "big", signed=True))
            continue
        if pid == 0:  # nothing of this loop may catch what the child raises: see _child
            control.close()
            os.close(wake_r)
            os.close(wake_w)
            _child(request, fds)
        for fd in fds[:3]:
            os.close(fd)
        children[pid] = fds[3]
        control.sendall(pid.to_bytes(8, "big", signed=True))
        _reap(children)


def _reap(children: dict[int, int]) -> None:
    """Tell each ended child's status pipe its wait status, then reap it: told first, so
    that its pid is not free for another process while the test may still signal it."""
    while children:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        status_w = children.pop(info.si_pid, None)
        if status_w is not None:
            with contextlib.suppress(OSError):  # nobody waits for it any more
                os.write(status_w, _wait_status(info).to_bytes(4, "big"))
            os.close(status_w)
        os.waitpid(info.si_pid, 0)


def _wait_status(info: Any) -> int:
    """waitpid's status word from waitid's answer."""
    if info.si_code == os.CLD_EXITED:
        return (int(info.si_status) & 0xFF) << 8
    return int(info.si_status) | (0x80 if info.si_code == os.CLD_DUMPED else 0)


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """Become `python -m app <argv>` as the request describes. It never returns: the app's
    exit (SystemExit, an uncaught exception, a KeyboardInterrupt) unwinds out of `_serve`
    and ends this interpreter as it would end a new one, its finalization included."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)  # inheritable: what this child starts inherits its stdio
    os.closerange(3, 1 << 16)  # what the server held: sockets, its children's pipes
    os.chdir(request["cwd"])
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    _stdio(env)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = ["-m", *request["argv"]]
    with contextlib.suppress(OSError):  # what `top` and `ps -o comm` show: its command
        with open("/proc/self/comm", "w") as comm:
            comm.write(" ".join(["qgw", *request["argv"][:1]])[:15])
    import runpy

    runpy.run_module("app", run_name="__main__", alter_sys=True)
    sys.exit(0)


def _stdio(env: dict[str, str]) -> None:
    """New text streams over fds 0-2, buffered as a new interpreter's would be for `env`
    (the encoding is the server's: its environment's, as the command's)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        stream: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(stream, encoding=encoding, errors=errors,
                                line_buffering=tty or fd == 2, write_through=unbuffered)

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                 encoding=encoding)
    sys.stdout = writer(1, sys.stdout.errors or "strict")
    sys.stderr = writer(2, "backslashreplace")


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
