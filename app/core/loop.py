"""One background loop shape for the lifecycle jobs: run a step every interval, back off on
errors (SQL or Redis down) and carry on when they come back, so the API never waits for them."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

#: What a store being down looks like from here (drivers raise OSError subclasses too).
STORE_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, RedisError, OSError,
                                                 TimeoutError)
MAX_BACKOFF_S = 2.0
BACKOFF_BASE_S = 0.1
T = TypeVar("T")


async def every(name: str, interval_s: float, step: Callable[[], Awaitable[object]],
                outages: tuple[type[BaseException], ...] = STORE_ERRORS) -> None:
    """Run `step` every `interval_s` until cancelled; after a failure, retry sooner than a
    long outage would suggest (at most MAX_BACKOFF_S), jittered so replicas do not align.
    `outages`: the errors that mean a store is away (logged in a line, not as a bug)."""
    failures = 0
    while True:
        try:
            await step()
            failures, delay = 0, interval_s
        except outages as exc:
            failures += 1
            ceiling = min(0.1 * 2 ** min(failures - 1, 8), max(MAX_BACKOFF_S, interval_s))
            delay = random.uniform(ceiling / 2, ceiling)
            level = logging.WARNING if failures == 1 or failures % 20 == 0 else logging.DEBUG
            log.log(level, "%s: %s: %s; retry %d in %.2f s", name, type(exc).__name__, exc,
                    failures, delay)
        except Exception:  # a bug must not end the loop silently and for good
            log.exception("%s failed", name)
            delay = max(interval_s, 1.0)
        await asyncio.sleep(delay)


async def persist(
    what: str, op: Callable[[], Awaitable[T]], window_s: float = float("inf")
) -> T | None:
    """Run a Redis step through an outage, retrying for up to `window_s`; None if it never
    went through (the dispatcher's acks retry until they land or it stops: the lease is still
    renewed meanwhile, so the result is not thrown away for a call made again)."""
    deadline = time.monotonic() + window_s
    failures = 0
    while True:
        try:
            return await op()
        except (RedisError, OSError) as exc:
            failures += 1
            if time.monotonic() >= deadline:
                log.warning("%s: redis error (%s); giving up after %d tries", what, exc,
                            failures)
                return None
            await backoff(what, exc, failures)


async def backoff(what: str, exc: Exception, failures: int) -> None:
    """Redis errors: 0.1 s doubling to 2 s, jittered, so replicas do not reconnect in step."""
    ceiling = min(BACKOFF_BASE_S * 2 ** min(failures - 1, 8), MAX_BACKOFF_S)
    delay = random.uniform(ceiling / 2, ceiling)
    level = logging.WARNING if failures == 1 or failures % 10 == 0 else logging.DEBUG
    log.log(level, "%s: redis error (%s); retry %d in %.2f s", what, exc, failures, delay)
    await asyncio.sleep(delay)
