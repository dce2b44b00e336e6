"""The lock (requirements/*.txt, written by `make lock`) is what pyproject.toml asks for, with
hashes, and it is what every install reads: `make`, the Dockerfile, CI (through `make`)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app import ROOT

REQUIREMENTS = ROOT / "requirements"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?:\s*;\s*(.+?))?\s*\\?$")
OURS = "queue-gateway (pyproject.toml)"
CLIENT = "queue-gateway-client (clients/python/pyproject.toml)"


@dataclass
class Pin:
    version: str
    hashes: int = 0
    via: set[str] = field(default_factory=set)


def read_lock(name: str) -> dict[str, Pin]:
    """Pins by canonical name, with their hash count and what asked for them (uv's notes)."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in (REQUIREMENTS / name).read_text().splitlines():
        stripped = line.strip()
        if m := PIN.match(line):
            current = pins[canonicalize_name(m[1])] = Pin(m[2])
        elif current is not None and stripped.startswith("--hash=sha256:"):
            current.hashes += 1
        elif current is not None and stripped.startswith("#"):
            note = stripped.lstrip("#").strip()
            note = note.removeprefix("via").strip()
            if note:
                current.via.add(note)
    return pins


def _project() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]
    return {"run": [Requirement(r) for r in project["dependencies"]],
            "test": [Requirement(r) for r in project["optional-dependencies"]["test"]],
            "client": [Requirement(r) for r in client["dependencies"]]}


def _agrees(pins: dict[str, Pin], wanted: list[Requirement], source: str) -> list[str]:
    """What is wrong between a lock and the requirements it was made from."""
    wrong = []
    names = {canonicalize_name(r.name) for r in wanted}
    for r in wanted:
        pin = pins.get(canonicalize_name(r.name))
        if pin is None:
            wrong.append(f"{r} is not in the lock")
        elif not r.specifier.contains(pin.version, prereleases=True):
            wrong.append(f"{r.name}=={pin.version} is outside {r.specifier}")
    asked = {n for n, p in pins.items() if source in p.via}
    wrong += [f"{n}: the lock has it from {source}, which no longer asks for it"
              for n in sorted(asked - names)]
    return wrong


def test_the_lock_matches_pyproject_toml() -> None:
    """`make lock` after changing a dependency: this fails until then."""
    project = _project()
    run, test = read_lock("run.txt"), read_lock("test.txt")
    wrong = _agrees(run, project["run"], OURS)
    wrong += _agrees(test, project["run"] + project["test"], OURS)
    wrong += _agrees(test, project["client"], CLIENT)
    # The test install adds to the runtime one, never moves it.
    wrong += [f"{n}: {p.version} in run.txt, {test[n].version} in test.txt"
              for n, p in run.items() if n in test and test[n].version != p.version]
    wrong += [f"{n} has no hash" for lock in (run, test) for n, p in lock.items()
              if not p.hashes]
    assert wrong == [], "run `make lock`:\n" + "\n".join(wrong)


def test_every_install_reads_the_lock() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "pip install -q --require-hashes -r requirements/run.txt" in make
    assert "pip install -q --require-hashes -r requirements/test.txt" in make
    # Anything else is installed without its dependencies: they come from the lock.
    loose = [line.strip() for line in make.splitlines()
             if re.search(r"pip install -q (?!--require-hashes|--no-deps|--upgrade pip|'uv)",
                          line)]
    assert loose == [], loose
    docker = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes -r requirements/run.txt" in docker
    assert re.search(r"pip install [^\n]*--no-deps[^\n]* \.", docker)


def test_redis_is_pinned_to_what_autopipe_was_tested_with() -> None:
    """app/core/autopipe.py reads redis-py's internals: an open upper bound would let a new
    release in untested (tests/test_autopipe.py guards the rest)."""
    (redis,) = [r for r in _project()["run"] if r.name == "redis"]
    assert any(s.operator == "<" for s in redis.specifier), redis
    assert read_lock("run.txt")["redis"].version in redis.specifier
