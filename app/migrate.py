"""Alembic migrations, run from code (`qgw migrate`, and `qgw serve` before it listens)."""

from __future__ import annotations

from alembic.config import Config

from alembic import command
from app import ROOT


def _config(db_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "alembic"))
    cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def upgrade(db_url: str) -> None:
    """Bring the database to the newest schema; call it outside a running event loop."""
    command.upgrade(_config(db_url), "head")
