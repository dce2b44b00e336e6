"""task results

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Same types as app.db.TaskResultRow: milliseconds kept on MySQL, results up to 16 MB.
_TIME = sa.DateTime().with_variant(mysql.DATETIME(fsp=3), "mysql", "mariadb")
_RESULT = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "task_results",
        sa.Column("task_id", sa.String(100), primary_key=True),
        sa.Column("user_id", sa.BigInteger(), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", _RESULT, nullable=True),
        sa.Column("result_status_code", sa.SmallInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
        sa.Column("started_at", _TIME, nullable=True),
        sa.Column("ended_at", _TIME, nullable=True),
    )
    # The janitor's range scan: oldest rows first, in batches.
    op.create_index("ix_task_results_created_at", "task_results", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_task_results_created_at", table_name="task_results")
    op.drop_table("task_results")
