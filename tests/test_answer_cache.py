"""The process's memory budget for large answers (app/answer_cache.py), on its own: what reads
pin is counted once per answer, the kept answers no read pins make way and the pinned ones
never do, and a read without room waits for one to end, else 429 too_many_reads."""

from __future__ import annotations

import asyncio

import pytest

from app.answer_cache import AnswerCache
from app.errors import ApiError

MB = 1 << 20


async def test_pinned_answers_are_never_evicted_and_count_once() -> None:
    cache = AnswerCache(max_bytes=10 * MB, wait_s=0.2)
    await cache.pin("a", 4 * MB)
    cache.put("a", "v", b"a" * 4 * MB)
    cache.settle("a", 4 * MB)
    await cache.pin("a", 4 * MB)  # a second reader of the same answer: no more bytes
    assert cache.pinned == 4 * MB and cache.held() == 4 * MB
    cache.put("b", "v", b"b" * 5 * MB)  # kept, unpinned: fits beside the pinned one
    cache.put("c", "v", b"c" * 5 * MB)  # no room: the unpinned b goes, pinned a stays
    assert cache.get("a", "v") is not None and cache.get("b", "v") is None
    assert cache.get("c", "v") is not None and cache.held() == 9 * MB
    await cache.pin("d", 5 * MB)  # a read's pin makes kept c give way too
    assert cache.get("c", "v") is None and cache.get("a", "v") is not None
    assert cache.held() == 9 * MB


async def test_a_read_without_room_waits_then_is_refused() -> None:
    cache = AnswerCache(max_bytes=10 * MB, wait_s=0.2)
    await cache.pin("a", 6 * MB)
    with pytest.raises(ApiError) as refused:
        await cache.pin("b", 6 * MB)
    assert refused.value.status == 429 and refused.value.code == "too_many_reads"
    assert refused.value.headers == {"Retry-After": "1"}
    waiting = asyncio.create_task(cache.pin("b", 6 * MB))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    cache.unpin("a")  # the stalled read ended: the waiting one gets in
    await asyncio.wait_for(waiting, 0.1)
    assert cache.pinned == 6 * MB


async def test_a_fill_shrinks_to_its_size_and_lets_others_in() -> None:
    cache = AnswerCache(max_bytes=10 * MB, wait_s=0.5)
    await cache.pin("a", 8 * MB)  # the estimate while it is built
    waiting = asyncio.create_task(cache.pin("b", 5 * MB))
    await asyncio.sleep(0.05)
    cache.settle("a", 4 * MB)  # built: 4 MB it is
    await asyncio.wait_for(waiting, 0.1)
    assert cache.pinned == 9 * MB


async def test_one_answer_larger_than_the_budget_is_read_alone() -> None:
    cache = AnswerCache(max_bytes=10 * MB, wait_s=0.1)
    await cache.pin("huge", 20 * MB)
    with pytest.raises(ApiError):
        await cache.pin("small", MB)
    cache.unpin("huge")
    await cache.pin("small", MB)
