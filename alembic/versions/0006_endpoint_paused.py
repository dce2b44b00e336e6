"""endpoints.paused

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

`paused` (docs/api.md): dispatch of the endpoint stops, submits are still accepted. Existing
endpoints keep running (false).
"""

import sqlalchemy as sa

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("paused", sa.Boolean(), nullable=False,
                                         server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("paused")
