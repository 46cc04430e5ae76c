"""model deletion, result files, estimated finish

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("deleted_at", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("estimated_finish", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("result_files", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_files")
        batch.drop_column("estimated_finish")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("deleted_at")
