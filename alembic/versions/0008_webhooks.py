"""api_keys.callback_urls and api_keys.webhook_secret

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23

Signed webhooks (docs/api.md): the URL prefixes a key's tasks may name as `callback_url` (a JSON
list, nullable: MySQL takes no literal default on a JSON column) and the secret their
deliveries are signed with. Existing keys get no callback URLs and a secret of their own.
"""

import secrets

import sqlalchemy as sa

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("callback_urls", sa.JSON(), nullable=True))
    op.add_column("api_keys", sa.Column("webhook_secret", sa.String(128), nullable=True))
    keys = sa.table("api_keys", sa.column("id", sa.String), sa.column("webhook_secret", sa.String),
                    sa.column("callback_urls", sa.JSON))
    conn = op.get_bind()
    for (key_id,) in conn.execute(sa.select(keys.c.id)).all():
        conn.execute(keys.update().where(keys.c.id == key_id).values(
            callback_urls=[], webhook_secret="whsec_" + secrets.token_hex(32)))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("webhook_secret")
        batch.drop_column("callback_urls")
