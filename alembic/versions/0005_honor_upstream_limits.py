"""endpoints.honor_upstream_limits

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

Whether an upstream's own rate-limit answers (429/503 with Retry-After, x-ratelimit-* at 0)
pause the endpoint fleet-wide; on for every endpoint, existing ones included.
"""

import sqlalchemy as sa

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("honor_upstream_limits", sa.Boolean(), nullable=False,
                                         server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("honor_upstream_limits")
