"""app/core/interrupt.py: a future's completion stops what the block awaits, once, and only
while inside it."""

from __future__ import annotations

import asyncio

import pytest

from app.core.interrupt import Interrupt


async def test_a_completed_future_stops_the_block_and_says_which() -> None:
    loop = asyncio.get_running_loop()
    gone, lost = loop.create_future(), loop.create_future()
    loop.call_later(0.05, lost.set_result, None)
    reached = False
    with Interrupt(gone, lost) as stop:
        await asyncio.sleep(10)
        reached = True
    assert stop.by is lost and not reached
    await asyncio.sleep(0)  # the task is not cancelled any more
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_block_that_ends_first_is_not_cancelled_later() -> None:
    """A future done just as the block ends (its callback already scheduled) cancels nothing
    that follows."""
    gone = asyncio.get_running_loop().create_future()
    with Interrupt(gone) as stop:
        gone.set_result(None)  # the callback runs at the loop's next turn, outside the block
    await asyncio.sleep(0.01)
    assert stop.by is None


@pytest.mark.parametrize("gone_first", [True, False])
async def test_a_cancellation_from_elsewhere_stays_one(gone_first: bool) -> None:
    gone = asyncio.get_running_loop().create_future()

    async def work() -> None:
        with Interrupt(gone):
            await asyncio.sleep(10)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.01)
    if gone_first:
        gone.set_result(None)
    task.cancel()
    if not gone_first:
        gone.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_an_error_in_the_block_goes_through() -> None:
    gone = asyncio.get_running_loop().create_future()
    with pytest.raises(ValueError), Interrupt(gone):
        raise ValueError("its own")
    assert not gone.done()


async def test_a_task_already_cancelling_is_still_interrupted() -> None:
    """A task that caught a cancellation and carries on (cancelling() stays 1) is interrupted
    as any other, its own count left as it was."""
    gone = asyncio.get_running_loop().create_future()

    async def work() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # caught, not uncancelled
        with Interrupt(gone) as stop:
            await asyncio.sleep(10)
        me = asyncio.current_task()
        assert me is not None
        return f"{stop.by is gone} {me.cancelling()}"

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    gone.set_result(None)
    assert await task == "True 1"
