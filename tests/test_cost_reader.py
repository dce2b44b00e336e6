"""The streamed answer's cost (`cost_from: "sse:..."`, app/proxy/cost.py) is read the same
however the stream is cut into reads: line ends split across reads, CR LF or CR alone, and a
line too long to read."""

from __future__ import annotations

import pytest

from app.proxy.cost import EVENT_BYTES, CostReader

STREAM = (b'data: {"id": 1}\r\n\r\n'
          b': a comment\n'
          b'data: {"usage": {"prompt_tokens": 3,\r'
          b'data:  "completion_tokens": 4}}\r\r'
          b'event: done\ndata: [DONE]\n\n')


def _read(stream: bytes, piece: int, cost_from: str) -> int | None:
    reader = CostReader(cost_from)
    for i in range(0, len(stream), piece):
        reader.feed(stream[i:i + piece])
    return reader.cost({})


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, len(STREAM)])
def test_the_cost_is_the_same_however_the_stream_is_cut(piece: int) -> None:
    spec = "sse:usage.prompt_tokens+usage.completion_tokens"
    assert _read(STREAM, piece, spec) == 7


@pytest.mark.parametrize("piece", [64, 4096])
def test_an_event_over_the_bound_is_skipped_and_the_next_one_read(piece: int) -> None:
    """A line longer than EVENT_BYTES is dropped whole (even when it comes a small read at a
    time, each kept until its line ends, not joined again at every read); the event after it
    still counts."""
    pad = b"x" * EVENT_BYTES
    huge = b'data: {"usage": {"total_tokens": 999, "pad": "' + pad + b'"}}\n\n'
    last = b'data: {"usage": {"total_tokens": 12}}\n\n'
    assert _read(huge + last, piece, "sse:usage.total_tokens") == 12
    assert _read(huge, piece, "sse:usage.total_tokens") is None
