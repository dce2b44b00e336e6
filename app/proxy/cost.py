"""A relayed answer's real cost, read while it streams by (`cost_from`, docs/api.md).

`sse:<path>[+<path>...]` reads server-sent events: each path's value is taken from the last
`data:` JSON event that has it, and the values are added. OpenAI's `stream_options.include_usage`
puts the usage in the last event: `sse:usage.total_tokens`. Anthropic's stream tells the input
tokens once, at its start (`message_start`), and the output tokens at its end (`message_delta`):
`sse:message.usage.input_tokens+usage.output_tokens`. `json:` and `header:` read as for queued
tasks (app/queue/upstream.py), the JSON body kept only up to JSON_BYTES for it.
"""

from __future__ import annotations

import json
from typing import Any

from app.queue.upstream import MAX_COST, at_path, real_cost

JSON_BYTES = 1 << 20  # a JSON answer larger than this is not read for its cost
EVENT_BYTES = 1 << 20  # nor an event larger than this


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None


class CostReader:
    """Fed the body's chunks as they pass; `cost(headers)` once it has ended."""

    def __init__(self, cost_from: str | None) -> None:
        where, _, spec = (cost_from or "").partition(":")
        self.where, self.cost_from = where, cost_from
        self._paths = [p.split(".") for p in spec.split("+")] if where == "sse" else []
        self._first = {p[0] for p in self._paths}  # a cheap test before parsing an event
        self._found: list[float | None] = [None] * len(self._paths)
        self._partial = b""
        self._json = bytearray() if where == "json" else None

    def feed(self, chunk: bytes) -> None:
        if self._json is not None:
            if len(self._json) + len(chunk) <= JSON_BYTES:
                self._json += chunk
            else:
                self._json = None
        elif self._paths:
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            if len(self._partial) > EVENT_BYTES:
                self._partial = b""
            for line in lines:
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if not data.startswith(b"{") or not any(f.encode() in data for f in self._first):
            return
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):  # an event nested thousands deep is no cost
            return
        for i, path in enumerate(self._paths):
            value = _number(at_path(event, path))
            if value is not None:
                self._found[i] = value

    def cost(self, headers: dict[str, str]) -> int | None:
        if self.where == "sse":
            if not self._paths or any(v is None for v in self._found):
                return None
            total = sum(v for v in self._found if v is not None)
            return round(total) if 0 <= total <= MAX_COST else None
        text = self._json.decode(errors="replace") if self._json is not None else ""
        return real_cost(self.cost_from, headers, text)
