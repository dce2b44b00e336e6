"""The repository stands on its own: a clone at any path, on any machine, is complete."""

from __future__ import annotations

import re
import subprocess

from app import ROOT

# Built from parts so that this file does not name what it looks for.
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:" + "|".join(["work", "root", "home", "Users"]) + r")/")
_OUTSIDE_DOC = re.compile(r"\.\./" + "shared" + r"|\b(?:API|DESIGN)\.md\b")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "-s"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return [entry for entry in out.split("\0") if entry]


def test_no_tracked_file_is_a_symlink() -> None:
    links = [entry.split("\t", 1)[1] for entry in _tracked() if entry.startswith("120000 ")]
    assert links == [], f"tracked symlinks point outside a clone: {links}"


def test_no_tracked_file_names_a_machine_path_or_a_document_outside_the_repository() -> None:
    found = []
    for entry in _tracked():
        name = entry.split("\t", 1)[1]
        path = ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: a favicon, a screenshot
        for n, line in enumerate(text.splitlines(), 1):
            if _MACHINE_PATH.search(line) or _OUTSIDE_DOC.search(line):
                found.append(f"{name}:{n}: {line.strip()[:120]}")
    assert found == [], "\n".join(found)
