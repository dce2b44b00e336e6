"""endpoints.forward_headers

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

The request headers an endpoint lets a task carry besides the default few (a JSON list of
names). Added nullable and filled with [] rather than given a default: MySQL takes no literal
default on a JSON column.
"""

import sqlalchemy as sa

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("forward_headers", sa.JSON(), nullable=True))
    op.execute("UPDATE endpoints SET forward_headers = '[]'")


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("forward_headers")
