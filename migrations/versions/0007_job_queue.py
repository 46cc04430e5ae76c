"""jobs.queue: the Celery queue a job's run messages go to (fair claims stay within it)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 15:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("queue", sa.String(length=200), nullable=False, server_default="tunehouse")
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue")
