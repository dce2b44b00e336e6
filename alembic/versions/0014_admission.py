"""Admission that learns: endpoints.max_starvation_s, concurrency, min_concurrency; tiers

Revision ID: 0014
Revises: 0010
Create Date: 2026-11-25

`max_starvation_s` (docs/api.md): a task waiting longer is served before higher priorities
(lua/includes/starvation.lua); none (the default) keeps strict priority. `tiers`: each tier's
weight on `fairness: "weighted"` endpoints (app/tiers.py); a tier not listed weighs 1.
`concurrency` "fixed" (existing endpoints) or "adaptive" (the cap learnt between
`min_concurrency` and `max_concurrency`, lua/includes/adaptive.lua).
"""

import sqlalchemy as sa

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("max_starvation_s", sa.Integer, nullable=True))
    op.add_column("endpoints", sa.Column("concurrency", sa.String(16), nullable=False,
                                         server_default="fixed"))
    op.add_column("endpoints", sa.Column("min_concurrency", sa.Integer, nullable=False,
                                         server_default="1"))
    op.create_table(
        "tiers",
        sa.Column("tier", sa.String(32), primary_key=True),
        sa.Column("weight", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tiers")
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("max_starvation_s")
        batch.drop_column("concurrency")
        batch.drop_column("min_concurrency")
