"""jobs: dispatch timestamps (outbox reconciler), restart count, pause request

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 11:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("restarts", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("queued_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("dispatched_at", sa.Float(), nullable=True))
        batch.add_column(
            sa.Column("pause_requested", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("pause_requested")
        batch.drop_column("dispatched_at")
        batch.drop_column("queued_at")
        batch.drop_column("restarts")
