"""base_models: the operator's catalogue of base models, stored once in the blob store; workers.stats:
each worker's live device figures

Revision ID: 0013_base_model_catalogue
Revises: 0012_tinker_runs
Create Date: 2026-11-28 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_base_model_catalogue"
down_revision: str | None = "0012_tinker_runs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "base_models",
        sa.Column("id", sa.String(length=300), nullable=False),
        sa.Column("source", sa.String(length=1000), nullable=False),
        sa.Column("revision", sa.String(length=64), nullable=False),
        sa.Column("blob_prefix", sa.String(length=500), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.add_column("workers", sa.Column("stats", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "stats")
    op.drop_table("base_models")
