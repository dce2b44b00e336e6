"""The README's walk-throughs, run as written against `qgw serve` on embedded defaults (what
`make run` starts): its shell lines (a queued task), then its endpoint for the OpenAI SDK and
its five lines of Python through the drop-in proxy. Only the ports differ, and `qgw` is this
test's."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from app import ROOT
from tests.servers import QGW, free_port, stop, wait_port


def blocks(text: str, heading: str, lang: str) -> list[str]:
    """The `lang` code blocks of the README's section under `heading`."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


async def test_the_readme_walkthroughs_run_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    port, mock, openai_mock = free_port(), free_port(), free_port()

    ports = {"8080": port, "9000": mock, "9001": openai_mock}

    def here(text: str) -> str:
        text = re.sub(r"\b(8080|9000|9001)\b", lambda m: str(ports[m[1]]), text)
        return text.replace(".venv/bin/qgw", shlex.join(QGW))

    (ten,) = blocks(readme, "Ten lines", "sh")
    (register,) = blocks(readme, "The OpenAI SDK through the gateway", "sh")
    (sdk,) = blocks(readme, "The OpenAI SDK through the gateway", "python")
    assert len(sdk.strip().splitlines()) == 5
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}
    gateway = subprocess.Popen([*QGW, "serve", "--port", str(port)], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The walk-through's own background servers (`&`) share its process group: ended with it.
    shell = None
    try:
        await asyncio.to_thread(wait_port, port, 60, gateway)
        script = f"set -e\n{here(ten)}\n{here(register)}\necho \"KEY=$KEY TASK=$TASK\"\n"
        # To files, not pipes: the servers it leaves running hold them open.
        with (tmp_path / "out").open("w") as out_f, (tmp_path / "err").open("w") as err_f:
            shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                                     start_new_session=True, stdout=out_f, stderr=err_f)
        await asyncio.to_thread(shell.wait, 60)
        out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
        assert shell.returncode == 0, err
        key, task = re.findall(r"KEY=(\S+) TASK=(\S+)", out)[-1]
        # Its last line waits for the next change of status, then is asked again until the
        # task is `completed` (the mock, started in the background, may answer its first
        # call late: a retry).
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=15,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            for _ in range(30):
                r = await http.get(f"/api/v1/tasks/{task}?wait=10")
                if r.json()["task_status"] not in ("pending", "processing"):
                    break
            assert r.json()["task_status"] == "completed", r.text
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", here(sdk)], capture_output=True, text=True,
            timeout=60, env={**env, "KEY": key})
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "the SDK printed no answer"
    finally:
        if shell is not None:
            try:
                os.killpg(shell.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        stop(gateway)
