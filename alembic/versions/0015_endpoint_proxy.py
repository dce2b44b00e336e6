"""endpoints.proxy

Revision ID: 0015
Revises: 0011, 0012 (0010 on its own branch; relinked when merged)
Create Date: 2026-11-25

`proxy` (docs/api.md, "Drop-in proxy"): the endpoint answers `ANY /proxy/{id}/{path}`. Existing
endpoints stay closed to it.
"""

import sqlalchemy as sa

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("proxy", sa.Boolean(), nullable=False,
                                         server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("proxy")
