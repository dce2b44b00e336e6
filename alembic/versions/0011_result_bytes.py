"""task_results.result_meta

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25

`result_meta` (app/queue/answers.py): the answer's Content-Type, size in bytes, how `result`
holds it (text, base64, or a reference into the result store), Content-Disposition and ETag,
as one JSON text. Rows written before it have none: their result is text, as it always was.
"""

import sqlalchemy as sa

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("task_results", sa.Column("result_meta", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("task_results") as batch:
        batch.drop_column("result_meta")
