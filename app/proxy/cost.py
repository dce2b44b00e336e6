"""A relayed answer's real cost, read while it streams by (`cost_from`, docs/api.md).

`sse:<path>[+<path>...]` reads server-sent events: each path's value is taken from the last
`data:` JSON event that has it, and the values are added. Events are read as the format has
them: lines end in CRLF, LF or CR, an event's `data:` lines are joined by newlines (JSON spread
over several), and a blank line ends it. OpenAI's `stream_options.include_usage`
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
        # A line begun, not yet ended: its pieces, joined once it ends (joined at each read, a
        # line trickling in small reads cost its length squared).
        self._partial: list[bytes] = []
        self._partial_len = 0
        self._dropping = False  # a line over EVENT_BYTES, dropped: its end is no blank line
        self._cr = False  # the last read ended in CR: an LF that opens the next ends no line
        self._data: list[bytes] = []  # the event's data lines so far
        self._size = 0  # their length: an event over EVENT_BYTES is not read
        self._json = bytearray() if where == "json" else None

    def feed(self, chunk: bytes) -> None:
        if self._json is not None:
            if len(self._json) + len(chunk) <= JSON_BYTES:
                self._json += chunk
            else:
                self._json = None
        elif self._paths:
            self._events(chunk)

    def _events(self, chunk: bytes) -> None:
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = chunk[-1:] == b"\r"
        if b"\n" not in chunk and b"\r" not in chunk:  # the line goes on
            self._partial.append(chunk)
            self._partial_len += len(chunk)
            if self._partial_len > EVENT_BYTES:  # the event it is in is not read
                self._partial, self._partial_len = [], 0
                self._dropping, self._size = True, EVENT_BYTES + 1
            return
        text = b"".join(self._partial) + chunk if self._partial else chunk
        if b"\r" in chunk:  # the pieces before hold no line end
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        rest = lines.pop()
        self._partial, self._partial_len = ([rest], len(rest)) if rest else ([], 0)
        if self._dropping and lines:  # the rest of the line dropped: gone with it
            lines.pop(0)
            self._dropping = False
        for line in lines:
            if not line:
                self._dispatch()
            elif line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                self._size += len(value) + 1
                if self._size <= EVENT_BYTES:
                    self._data.append(value)
        if self._partial_len > EVENT_BYTES:  # the event it is in is not read
            self._partial, self._partial_len = [], 0
            self._dropping, self._size = True, EVENT_BYTES + 1

    def _dispatch(self) -> None:
        """The event's end (a blank line, or the stream's)."""
        if self._data and self._size <= EVENT_BYTES:
            self._event(b"\n".join(self._data).strip())
        self._data, self._size = [], 0

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
            self._events(b"\n\n")  # one the stream ended without its line ends still counts
            if not self._paths or any(v is None for v in self._found):
                return None
            total = sum(v for v in self._found if v is not None)
            return round(total) if 0 <= total <= MAX_COST else None
        text = self._json.decode(errors="replace") if self._json is not None else ""
        return real_cost(self.cost_from, headers, text)
