"""tables in utf8mb4 on MySQL/MariaDB

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

The tables were created in the database's default character set, which on many servers is
latin1: a result or a name with a character outside it ("猫", an emoji) then failed to be
written at all. Only tables not yet in utf8mb4 are converted (a conversion rebuilds the table).
SQLite stores UTF-8 whatever: nothing to do there.
"""

import sqlalchemy as sa

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TABLES = ("endpoints", "api_keys", "task_results")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name not in ("mysql", "mariadb"):
        return
    rows = bind.execute(sa.text(
        "SELECT t.table_name, c.character_set_name FROM information_schema.tables t "
        "JOIN information_schema.collation_character_set_applicability c "
        "ON c.collation_name = t.table_collation "
        "WHERE t.table_schema = DATABASE()")).all()
    charsets = {str(name).lower(): str(charset) for name, charset in rows}
    for table in TABLES:
        if charsets.get(table, "utf8mb4") != "utf8mb4":
            op.execute(f"ALTER TABLE {table} CONVERT TO CHARACTER SET utf8mb4 "
                       "COLLATE utf8mb4_unicode_ci")


def downgrade() -> None:
    """Nothing to undo: utf8mb4 holds everything the old character set did."""
