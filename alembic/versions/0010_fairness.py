"""endpoints.fairness

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23

`fairness` (docs/api.md): "fifo" (arrival order inside a priority band) or "per_user" (users with
tasks pending in the same band take turns, lua/includes/fairness.lua). Existing endpoints
keep "fifo".
"""

import sqlalchemy as sa

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("fairness", sa.String(16), nullable=False,
                                         server_default="fifo"))


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("fairness")
