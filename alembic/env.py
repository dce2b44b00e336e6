"""Alembic environment: async engines for MySQL (aiomysql) and SQLite (aiosqlite)."""

import asyncio
import contextlib

from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from app.db import Base

config = context.config
target_metadata = Base.metadata


#: How long a replica waits for another one's migration to finish.
LOCK_WAIT_S = 300


def _configure(connection: Connection) -> None:
    # MySQL runs DDL outside transactions: replicas migrating at once would both create the
    # same table and one would fail. A named lock (held by the session, not a transaction)
    # lines them up; the later one then finds the schema at head and does nothing.
    mysql = connection.dialect.name in ("mysql", "mariadb")
    if mysql:
        got = connection.exec_driver_sql(
            f"SELECT GET_LOCK('qgw_migrate', {LOCK_WAIT_S})").scalar()
        connection.commit()
        if got != 1:
            raise TimeoutError(f"another migration held the lock for {LOCK_WAIT_S} s")
    try:
        # SQLite cannot ALTER most things in place: batch mode rebuilds tables instead.
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if mysql:  # a connection that died took its lock along; its error is the one to see
            with contextlib.suppress(Exception):
                connection.exec_driver_sql("SELECT RELEASE_LOCK('qgw_migrate')")
                connection.commit()


async def _run() -> None:
    url = config.get_main_option("sqlalchemy.url") or ""
    engine = create_async_engine(url, poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(_configure)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run())
