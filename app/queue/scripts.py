"""Lua scripts from `lua/`, with `--@include` resolved, registered once per client.

redis-py's `Script` runs EVALSHA and reloads the script on NOSCRIPT (after a Redis restart).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from app import ROOT

LUA_DIR = ROOT / "lua"
_INCLUDE = re.compile(r"^--@include (\S+)$", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The text of `lua/<name>-<n>.lua` with its includes inlined."""
    (path,) = LUA_DIR.glob(f"{name}-[0-9].lua")
    return _resolve(path)


def _resolve(path: Path) -> str:
    text = path.read_text()
    return _INCLUDE.sub(lambda m: (LUA_DIR / "includes" / m.group(1)).read_text(), text)


@dataclass(frozen=True, slots=True)
class Scripts:
    submit: AsyncScript
    claim: AsyncScript
    ack: AsyncScript
    extend: AsyncScript
    reap: AsyncScript
    cancel: AsyncScript
    status: AsyncScript
    promote: AsyncScript
    complete: AsyncScript
    permit: AsyncScript
    release: AsyncScript
    nudge: AsyncScript

    @classmethod
    def register(cls, redis: Redis) -> Scripts:
        names = cls.__dataclass_fields__
        return cls(**{n: redis.register_script(source(n)) for n in names})
