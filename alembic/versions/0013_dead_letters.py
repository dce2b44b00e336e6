"""task_results keep a dead letter's request; an index to search every endpoint's endings

Revision ID: 0013
Revises: 0010
Create Date: 2026-11-25

`failed` and `expired` tasks stay for QGW_DB_RETENTION_S, read or not (docs/guides/dead-letters.md):
their row carries the `priority` and the `request` (JSON: method, URL, forwarded headers, query,
body up to 64 KiB, the task's place in line), so an operator's retry runs them again once Redis
let them go. GET /admin/v1/tasks searches by status and end time across endpoints: without
(status, ended_at) every page would scan the whole table.
"""

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    text = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
    op.add_column("task_results", sa.Column("priority", sa.Integer(), nullable=True))
    op.add_column("task_results", sa.Column("request", text, nullable=True))
    op.create_index("ix_task_results_status_ended", "task_results", ["status", "ended_at"])


def downgrade() -> None:
    op.drop_index("ix_task_results_status_ended", table_name="task_results")
    with op.batch_alter_table("task_results") as batch:
        batch.drop_column("request")
        batch.drop_column("priority")
