"""Alembic migrations, run from code (`qgw migrate`, and `qgw serve` before it listens).

Every start of `qgw serve`, `api` or `dispatcher` migrates (QGW_AUTO_MIGRATE), and nearly
always finds the database at head. Alembic's way to find that out (import Alembic, run
alembic/env.py, import every migration to learn the head) cost 0.25 s of CPU a start; the
head is the newest migration file's revision (`NNNN_name.py` holds revision "NNNN": a test
holds them together), so a start reads the database's revision and compares.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from app import data_path

if TYPE_CHECKING:
    from alembic.config import Config

VERSION_TABLE = "alembic_version"  # Alembic's default, which alembic/env.py keeps


def _config(db_url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(data_path("alembic")))
    cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def head() -> str:
    """The newest revision: the number of the newest migration file."""
    versions = data_path("alembic") / "versions"
    return max(p.name[:4] for p in versions.glob("[0-9][0-9][0-9][0-9]_*.py"))


def upgrade(db_url: str) -> None:
    """Bring the database to the newest schema; call it outside a running event loop. A
    database that cannot be read raises here (its own error), not again through Alembic."""
    if _current(db_url) == head():
        return
    from alembic import command

    command.upgrade(_config(db_url), "head")


def pending(db_url: str) -> str | None:
    """Why the database is not at the newest schema (a one-line reason), or None if it is."""
    at, want = _current(db_url), head()
    if at == want:
        return None
    return f"the database is at revision {at or 'none (empty)'}, the code needs {want}"


def _current(db_url: str) -> str | None:
    """The database's revision (Alembic's version table), None when it has none. Any other
    error (locked, unreachable, not allowed) is raised as it is."""
    from sqlalchemy import Connection, inspect, make_url, pool, text
    from sqlalchemy.ext.asyncio import create_async_engine

    url = make_url(db_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        # Said plainly, and before aiosqlite's thread fails to open it and then reports to
        # a loop already closed (a traceback printed on top of the operator's one line).
        folder = Path(str(url.database)).parent
        if not folder.is_dir():
            raise FileNotFoundError(f"no directory {folder} for the SQLite database")

    def revision(conn: Connection) -> str | None:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        found = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one_or_none()
        return str(found) if found is not None else None

    async def read() -> str | None:
        engine = create_async_engine(db_url, poolclass=pool.NullPool)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(revision)
        finally:
            await engine.dispose()

    return asyncio.run(read())
