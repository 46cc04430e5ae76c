"""workers.device, device_name, device_memory_bytes: what each device of a live worker holds, for the
pre-flight estimate's "fits" per worker kind

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 16:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("device", sa.String(length=20), nullable=False, server_default="cpu"))
        batch.add_column(sa.Column("device_name", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("device_memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("device_memory_bytes")
        batch.drop_column("device_name")
        batch.drop_column("device")
