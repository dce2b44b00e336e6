"""The tests' warm starts (tests/warm.py) behave as cold ones: same answers, same ends, real
pids, and a fork server's death does not make its children read as ended. Each case runs in a
process of its own with a fork server of its own, whatever this worker's mode."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_PRELUDE = """
import json, os, signal, subprocess, sys, time
import psutil
from tests import warm
from tests.servers import QGW, free_port, wait_port
warm.install()
assert warm._server is not None

def mock():
    port = free_port()
    proc = subprocess.Popen([*QGW, "mock-upstream", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, 30, proc)
    return proc

def run(args, **kw):
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)
    return [done.returncode, done.stdout, done.stderr]
"""


def _in_own_process(body: str) -> Any:
    """Run `body` after the prelude in a new interpreter; it prints one JSON line last."""
    script = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_command_answers_as_a_cold_one_from_a_forked_child() -> None:
    got = _in_own_process("""
        proc = mock()
        parent = psutil.Process(proc.pid).ppid()  # the fork server's child, not a new exec
        comm = psutil.Process(proc.pid).name()
        proc.kill()
        killed = proc.wait(10)
        term = mock()
        term.terminate()
        ended = term.wait(30)
        cold = dict(executable=sys.executable)  # a command with its own executable: cold
        print(json.dumps({
            "forked": parent == warm._server.pid, "comm": comm, "killed": killed,
            "terminated": ended,
            "version": [run([*QGW, "--version"]), run([*QGW, "--version"], **cold)],
            "bad": [run([*QGW, "nosuch"]), run([*QGW, "nosuch"], **cold)],
            "exit": [run([*QGW, "tasks"]), run([*QGW, "tasks"], **cold)],
        }))
    """)
    assert got["forked"] and got["comm"] == "qgw mock-upstre", got
    assert got["killed"] == -9 and got["terminated"] in (0, -15), got
    for warm_answer, cold_answer in (got["version"], got["bad"], got["exit"]):
        assert warm_answer == cold_answer
    assert got["version"][0][0] == 0 and got["bad"][0][0] == got["exit"][0][0] == 2


def test_a_fork_servers_death_leaves_its_running_children_running() -> None:
    """Its children are not taken for ended (nor left unsignalled) while they run; their
    code, lost with the server, reads as 255. A Ctrl-C does not kill the server."""
    got = _in_own_process("""
        proc = mock()
        os.kill(warm._server.pid, signal.SIGINT)
        time.sleep(0.3)
        survived_sigint = warm._server.poll() is None
        os.kill(warm._server.pid, signal.SIGKILL)
        warm._server.wait(10)
        running = proc.poll() is None and psutil.pid_exists(proc.pid)
        proc.kill()
        print(json.dumps({"sigint": survived_sigint, "running": running,
                          "code": proc.wait(10)}))
    """)
    assert got == {"sigint": True, "running": True, "code": 255}
