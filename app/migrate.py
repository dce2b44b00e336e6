"""Alembic migrations, run from code (`qgw migrate`, and `qgw serve` before it listens)."""

from __future__ import annotations

from alembic.config import Config

from alembic import command
from app import data_path


def _config(db_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(data_path("alembic")))
    cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def upgrade(db_url: str) -> None:
    """Bring the database to the newest schema; call it outside a running event loop."""
    command.upgrade(_config(db_url), "head")


def pending(db_url: str) -> str | None:
    """Why the database is not at the newest schema (a one-line reason), or None if it is."""
    import asyncio

    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import pool
    from sqlalchemy.ext.asyncio import create_async_engine

    head = ScriptDirectory.from_config(_config(db_url)).get_current_head()

    async def current() -> str | None:
        engine = create_async_engine(db_url, poolclass=pool.NullPool)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda c: MigrationContext.configure(c).get_current_revision())
        finally:
            await engine.dispose()

    at = asyncio.run(current())
    if at == head:
        return None
    return f"the database is at revision {at or 'none (empty)'}, the code needs {head}"
