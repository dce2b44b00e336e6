"""endpoints.limits and endpoints.cost_from

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23

Several limits per endpoint (a JSON list of {limiter, rate, interval_ms, per}), and where a
finished call's real cost is read. `limits` is added nullable and filled with [] rather than
given a default: MySQL takes no literal default on a JSON column.
"""

import sqlalchemy as sa

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("limits", sa.JSON(), nullable=True))
    op.add_column("endpoints", sa.Column("cost_from", sa.String(200), nullable=True))
    op.execute("UPDATE endpoints SET limits = '[]'")


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("cost_from")
        batch.drop_column("limits")
