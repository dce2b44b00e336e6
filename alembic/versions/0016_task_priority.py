"""task_results.priority

Revision ID: 0011_task_priority
Revises: 0010
Create Date: 2026-11-25

A finished task's priority, so an operator's listing of failed tasks shows it once Redis has
let the task go. Rows written before stay NULL (not known).
"""

import sqlalchemy as sa

from alembic import op

revision = "0016"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("task_results", sa.Column("priority", sa.SmallInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("task_results") as batch:
        batch.drop_column("priority")
