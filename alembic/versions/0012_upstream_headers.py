"""endpoints.upstream_headers

Revision ID: 0012
Revises: 0010
Create Date: 2026-11-25

Headers an endpoint sends on every call (the provider's credentials, docs/guides/credentials.md):
a JSON object of name -> value sealed with AES-GCM (app/secrets.py), never a plain value. Added
nullable and filled with {}: MySQL takes no literal default on a JSON column.
"""

import sqlalchemy as sa

from alembic import op

revision = "0012"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("endpoints", sa.Column("upstream_headers", sa.JSON(), nullable=True))
    op.execute("UPDATE endpoints SET upstream_headers = '{}'")


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_column("upstream_headers")
