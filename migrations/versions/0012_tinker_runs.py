"""tinker_sessions, tinker_runs, tinker_checkpoints.expires_at: durable Tinker runs and checkpoint TTLs

Revision ID: 0012_tinker_runs
Revises: 0011
Create Date: 2026-11-29 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_tinker_runs"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", sa.String(length=60), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("finish_reason", sa.String(length=20), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tinker_sessions_tenant_id", "tinker_sessions", ["tenant_id"])
    op.create_table(
        "tinker_runs",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("session_id", sa.String(length=60), nullable=False),
        sa.Column("base_model", sa.String(length=600), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tinker_runs_tenant_id", "tinker_runs", ["tenant_id"])
    op.create_index("ix_tinker_runs_session_id", "tinker_runs", ["session_id"])
    op.add_column("tinker_checkpoints", sa.Column("expires_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("tinker_checkpoints", "expires_at")
    op.drop_index("ix_tinker_runs_session_id", table_name="tinker_runs")
    op.drop_index("ix_tinker_runs_tenant_id", table_name="tinker_runs")
    op.drop_table("tinker_runs")
    op.drop_index("ix_tinker_sessions_tenant_id", table_name="tinker_sessions")
    op.drop_table("tinker_sessions")
