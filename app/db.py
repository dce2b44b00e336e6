"""SQL: the endpoint table and API keys (the sources of truth), finished tasks kept for
`QGW_DB_RETENTION_S` (app/lifecycle), engine and sessions."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

T = TypeVar("T")


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class EndpointRow(Base):
    __tablename__ = "endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    target_url: Mapped[str] = mapped_column(String(2048))
    methods: Mapped[list[str]] = mapped_column(JSON)
    limiter: Mapped[str] = mapped_column(String(32))
    rate: Mapped[int] = mapped_column(Integer)
    interval_ms: Mapped[int] = mapped_column(Integer)
    max_concurrency: Mapped[int] = mapped_column(Integer)
    avg_exec_ms: Mapped[int] = mapped_column(Integer)
    timeout_ms: Mapped[int] = mapped_column(Integer)
    max_retries: Mapped[int] = mapped_column(Integer)
    retry_backoff_ms: Mapped[int] = mapped_column(Integer)
    max_queue_len: Mapped[int] = mapped_column(Integer)
    permit_ttl_s: Mapped[int] = mapped_column(Integer)
    permit_max_uses: Mapped[int] = mapped_column(Integer)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    forward_headers: Mapped[list[str]] = mapped_column(JSON, nullable=True, default=list)
    honor_upstream_limits: Mapped[bool] = mapped_column(Boolean, default=True)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    limits: Mapped[list[dict[str, object]]] = mapped_column(JSON, nullable=True, default=list)
    cost_from: Mapped[str | None] = mapped_column(String(200), nullable=True)
    fairness: Mapped[str] = mapped_column(String(16), default="fifo")
    proxy: Mapped[bool] = mapped_column(Boolean, default=False)
    #: name -> value sealed with AES-GCM (app/secrets.py); never a plain value.
    upstream_headers: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True,
                                                                     default=dict)
    max_starvation_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    concurrency: Mapped[str] = mapped_column(String(16), default="fixed")
    min_concurrency: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)


class TierRow(Base):
    """A tier of API keys and its weight in `fairness: weighted` shares (default 1)."""

    __tablename__ = "tiers"

    tier: Mapped[str] = mapped_column(String(32), primary_key=True)
    weight: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int] = mapped_column(BigInteger, index=True)
    tier: Mapped[str] = mapped_column(String(32))
    max_priority: Mapped[int] = mapped_column(Integer)
    daily_quota: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    #: URL prefixes its tasks' callback_url must lie under, and the secret that signs their
    #: webhooks (kept in clear: the dispatchers sign with it; shown to the admin once).
    callback_urls: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=list)
    webhook_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)


#: Task times keep their milliseconds on MySQL too (its DATETIME drops them by default).
TaskTime = DateTime().with_variant(mysql.DATETIME(fsp=3), "mysql", "mariadb")
#: A result is the business API's body: up to 16 MB on MySQL (TEXT stops at 64 KB).
ResultText = Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


class TaskResultRow(Base):
    """A finished task, written from the Redis outbox; status falls back to it once Redis has
    let the task go. `created_at` is indexed: the janitor deletes by it in batches; so is
    (endpoint, status, ended_at): an operator lists an endpoint's failures newest first; and
    (status, ended_at): an operator searches every endpoint's (GET /admin/v1/tasks)."""

    __tablename__ = "task_results"
    __table_args__ = (Index("ix_task_results_endpoint_status_ended", "endpoint", "status",
                            "ended_at"),
                      Index("ix_task_results_status_ended", "status", "ended_at"))

    task_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    user_id: Mapped[int] = mapped_column(BigInteger)
    endpoint: Mapped[str] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[str | None] = mapped_column(ResultText, nullable=True)
    result_status_code: Mapped[int | None] = mapped_column(SmallInteger, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(TaskTime, index=True)
    started_at: Mapped[datetime | None] = mapped_column(TaskTime, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(TaskTime, nullable=True)
    #: The answer's type, size, encoding and store key (app/queue/answers.py), as JSON.
    result_meta: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The priority it ran at, so listings of failed tasks show it (NULL: written before 0013),
    # and a dead letter's (failed, expired) request, JSON, for an operator's retry.
    priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    request: Mapped[str | None] = mapped_column(ResultText, nullable=True)


#: A dead database must not hold a request (status fallback) or a loop for long. The driver's
#: connect timeout covers only opening the socket: a server that accepts and then stops
#: answering (paused, or a black-holed link) would hold a query until TCP gives up, so every
#: statement is bounded too, from the caller's side: `bounded` on the request path,
#: asyncio.timeout around a background batch.
SQL_CONNECT_TIMEOUT_S = 3
SQL_REQUEST_TIMEOUT_S = 3.0  # on the request path: then 503 (QGW_SQL_TIMEOUT_S)
SQL_JOB_TIMEOUT_S = 30  # one batch of a background job (outbox, purge): then retried
SQLITE_BUSY_TIMEOUT_S = 5  # a SQLite statement waits this long for another's lock, then fails


_abandoned: set[asyncio.Future[Any]] = set()
_request_timeout_s = SQL_REQUEST_TIMEOUT_S


def set_request_timeout(timeout_s: float) -> None:
    """The process's bound on the request path (QGW_SQL_TIMEOUT_S), set once at start as
    the keyring is (app/secrets.py): every store's statement reads it."""
    global _request_timeout_s
    _request_timeout_s = timeout_s


async def bounded(work: Awaitable[T], timeout_s: float | None = None) -> T:
    """`work`'s result within `timeout_s` (default: the request path's bound), else
    TimeoutError, without waiting for its clean-up.

    Cancelled inside `asyncio.timeout`, a statement on a server that stopped answering still
    returns its connection on the way out (a ROLLBACK), which waits on that server in turn:
    a request could hang after all. Here the work runs as a task of its own and is left to
    end in the background; the request answers at once.
    """
    if timeout_s is None:
        timeout_s = _request_timeout_s
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task in done:
        return task.result()
    task.cancel()
    _abandoned.add(task)  # kept referenced until it has ended
    task.add_done_callback(_abandoned.discard)
    raise TimeoutError(f"the database did not answer within {timeout_s:g} s")


async def settle(timeout_s: float = SQLITE_BUSY_TIMEOUT_S + 1) -> None:
    """Let the statements `bounded` left behind end, before their engine is disposed.

    Each was cancelled once and is closing its connection. Cancelled again (as `asyncio.run`
    does to every task left at exit), aiosqlite's close can wait for a worker thread that has
    already stopped, and the process never exits (`qgw tasks retry` hung so, a SQLite write
    lock held elsewhere). Past the busy timeout a SQLite one has ended; one on a server that
    stopped answering is left to that cancellation, which closes its socket.
    """
    loop = asyncio.get_running_loop()  # another loop's (a test's earlier one) are not ours
    mine = {task for task in _abandoned if task.get_loop() is loop}
    if mine:
        await asyncio.wait(mine, timeout=timeout_s)


def make_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        return create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
    return create_async_engine(url, pool_pre_ping=True, pool_recycle=3600, pool_timeout=5,
                               connect_args={"connect_timeout": SQL_CONNECT_TIMEOUT_S})


def sessions(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    return async_sessionmaker(engine, expire_on_commit=False)
