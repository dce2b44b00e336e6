"""task_results index by endpoint, status and end

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

An operator lists an endpoint's finished tasks of one status, newest first, a page at a time
(GET /admin/v1/endpoints/{id}/tasks?status=failed): without this index every page would scan
the whole table (days of rows).
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_task_results_endpoint_status_ended", "task_results",
                    ["endpoint", "status", "ended_at"])


def downgrade() -> None:
    op.drop_index("ix_task_results_endpoint_status_ended", table_name="task_results")
