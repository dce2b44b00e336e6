"""scripts/system-deps, which `make test` runs first: where it cannot install what the tests
need (not root, not Debian), it stops with one line naming the exact packages. (On Debian as
root it installs them: CI's fresh machines run that branch through `make test`.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from app import ROOT

PACKAGES = {"python3-venv", "mariadb-server", "nginx-light", "chromium", "prometheus", "curl"}


def test_without_root_it_names_the_missing_packages_in_one_line(tmp_path: Path) -> None:
    # A PATH with none of the tools (the script adds the sbin directories, where nginx and
    # mariadbd may be found), and a user who cannot install anything.
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    as_user = [runuser, "-u", "nobody", "--"] if os.getuid() == 0 else []
    script = (ROOT / "scripts" / "system-deps").read_bytes()
    done = subprocess.run([*as_user, "/bin/bash", "-s"], input=script, capture_output=True,
                          env={"PATH": str(tmp_path)}, cwd="/", timeout=30)
    assert done.returncode == 1 and done.stdout == b""
    (line,) = done.stderr.decode().splitlines()
    head, _, named = line.partition(": ")
    assert head == "make test needs the system packages", line
    missing = named.split(" (")[0].split()
    assert {"chromium", "prometheus"} <= set(missing) <= PACKAGES, line
    assert line.endswith(f"(Debian: apt-get install {' '.join(missing)})")


def test_make_run_needs_only_a_python_that_can_make_a_venv(tmp_path: Path) -> None:
    """`make run` asks for python3-venv alone (Debian's python3 has no ensurepip without it),
    and nothing when the Python given can make a venv."""
    script = str(ROOT / "scripts" / "system-deps")
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    as_user = [runuser, "-u", "nobody", "--"] if os.getuid() == 0 else []
    # On stdin: `nobody` may not read a clone in a private directory (mktemp -d is 0700).
    done = subprocess.run([*as_user, "/bin/bash", "-s", "run"], capture_output=True,
                          input=Path(script).read_bytes(),
                          env={"PATH": str(tmp_path), "PYTHON": "/nonexistent/python3"},
                          cwd="/", timeout=30)
    assert done.returncode == 1
    assert done.stderr.decode().strip() == ("make run needs the system packages: python3-venv "
                                            "(Debian: apt-get install python3-venv)")
    fine = subprocess.run(["/bin/bash", script, "run"], capture_output=True, timeout=30,
                          env={**os.environ, "PYTHON": sys.executable})
    assert (fine.returncode, fine.stderr) == (0, b"")
