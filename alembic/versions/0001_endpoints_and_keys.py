"""endpoints and api keys

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoints",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("target_url", sa.String(2048), nullable=False),
        sa.Column("methods", sa.JSON(), nullable=False),
        sa.Column("limiter", sa.String(32), nullable=False),
        sa.Column("rate", sa.Integer(), nullable=False),
        sa.Column("interval_ms", sa.Integer(), nullable=False),
        sa.Column("max_concurrency", sa.Integer(), nullable=False),
        sa.Column("avg_exec_ms", sa.Integer(), nullable=False),
        sa.Column("timeout_ms", sa.Integer(), nullable=False),
        sa.Column("max_retries", sa.Integer(), nullable=False),
        sa.Column("retry_backoff_ms", sa.Integer(), nullable=False),
        sa.Column("max_queue_len", sa.Integer(), nullable=False),
        sa.Column("permit_ttl_s", sa.Integer(), nullable=False),
        sa.Column("permit_max_uses", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("user_id", sa.BigInteger(), nullable=False, index=True),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("max_priority", sa.Integer(), nullable=False),
        sa.Column("daily_quota", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("endpoints")
