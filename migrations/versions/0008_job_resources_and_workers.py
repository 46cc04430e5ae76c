"""jobs.resources (GPUs per job) and the workers table (what each live worker can run)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 20:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("resources", sa.JSON(), nullable=True))
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=200), primary_key=True),
        sa.Column("queue", sa.String(length=200), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resources")
