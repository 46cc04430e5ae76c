"""tinker_checkpoints: a Tinker checkpoint is a tunehouse model (`ft:...:tinker:...`, `ftckpt-...`)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 19:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tinker_checkpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("training_run_id", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tinker_path", sa.String(length=600), nullable=False),
        sa.Column("fine_tuned_model", sa.String(length=800), nullable=False),
        sa.Column("base_model", sa.String(length=600), nullable=False),
        sa.Column("blob_key", sa.String(length=500), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_tinker_checkpoints_tenant_path", "tinker_checkpoints", ["tenant_id", "tinker_path"], unique=True
    )
    op.create_index(
        "ix_tinker_checkpoints_tenant_model", "tinker_checkpoints", ["tenant_id", "fine_tuned_model"]
    )


def downgrade() -> None:
    op.drop_index("ix_tinker_checkpoints_tenant_model", table_name="tinker_checkpoints")
    op.drop_index("ix_tinker_checkpoints_tenant_path", table_name="tinker_checkpoints")
    op.drop_table("tinker_checkpoints")
