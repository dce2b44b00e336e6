"""Logs: one JSON object a line when not on a terminal, readable lines on one; never a secret.

Lines about a task carry `task_id` and `endpoint` (passed with `extra=`).  Every finished line,
JSON or text, goes through `scrub`: API keys, permits, bearer tokens, credential-like
`name=value` pairs, URL query strings (they may carry a caller's key) and the values registered
with `redact` (the admin token, the permit secret) are replaced before the line is written.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# Attributes every LogRecord has; anything else came in through `extra=` and is printed.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message", "taskName"}

REDACTED = "[redacted]"
_NAME = (r"(?i)(?P<name>\b[\w-]*(?:authorization|x-api-key|x-queue-permit|api[_-]?key"
         r"|access[_-]?token|token|secret|passw(?:or)?d|permit|private[_-]?key|credentials?)\d*"
         r"(?:\\*[\"'])?\s*[:=]\s*")
_PATTERNS = [
    (re.compile(r"qgw_[A-Za-z0-9_-]{16,}"), "qgw_" + REDACTED),  # API keys (app/store.py)
    (re.compile(r"\b\d{13}\.[A-Za-z0-9_-]{43}\b"), REDACTED),  # permits (app/permits.py)
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',;\\]+"), r"\1 " + REDACTED),
    # A credential-like name (with a prefix or a number: client_secret, db_passwd, password2)
    # and its value. The quotes around both may come escaped, once per level of JSON a string
    # went through (an upstream's JSON error body inside our JSON line: `\\\"`); a quoted
    # value is hidden up to its closing quote, spaces and all.
    (re.compile(_NAME + r"(?P<q>\\*[\"'])).*?(?=(?P=q))"), r"\g<name>" + REDACTED),
    (re.compile(_NAME + r"(?:\\*[\"'])?)[^\s\"'&,;}\\]+"), r"\g<name>" + REDACTED),
    (re.compile(r"(?i)\b(https?://[^\s?#\"'<>\\]+)\?[^\s#\"'<>\\]*"), r"\1?" + REDACTED),
    (re.compile(r"(?i)(redis|rediss|mysql\+aiomysql)://([^:/@\s]*):[^@\s]*@"),
     r"\1://\2:" + REDACTED + "@"),
]
_values: set[str] = set()


def redact(*values: str) -> None:
    """Never print these (secrets without a recognisable shape): as they are, and as a JSON
    line escapes them (a quote, a backslash, a character past ASCII)."""
    for v in values:
        if v and len(v) >= 8:
            _values.update({v, json.dumps(v)[1:-1], json.dumps(v, ensure_ascii=False)[1:-1]})


def clipped(text: str, most: int) -> str:
    """`text` scrubbed, then cut to `most` characters: cut first, a value that crossed the cut
    would show its beginning, which no longer reads as the value."""
    longest = max(map(len, _values), default=0)
    return scrub(text[:most + longest])[:most]


def scrub(line: str) -> str:
    for value in _values:
        if value in line:
            line = line.replace(value, REDACTED)
    for pattern, repl in _PATTERNS:
        line = pattern.sub(repl, line)
    return line


def _extra(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extra(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return scrub(json.dumps(out, default=str))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = _extra(record)
        if extra:
            line += "  " + " ".join(f"{k}={v}" for k, v in extra.items())
        return scrub(line)


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if sys.stderr.isatty():
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Debug means ours: the drivers' debug lines carry SQL parameters (key hashes, results)
    # and no task id, and outnumber ours many times over.
    # alembic.runtime.plugins says at import (commands import alembic lazily) which of its
    # own plugins it set up: a line each, on every start.
    for noisy in ("httpx", "aiosqlite", "asyncio", "sqlalchemy", "aiomysql", "aiohttp",
                  "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
