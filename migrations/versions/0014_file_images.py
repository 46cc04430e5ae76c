"""files.images, files.image_examples: the image parts of a training file's rows (issue 55)

Revision ID: 0014_file_images
Revises: 0013_base_model_catalogue
Create Date: 2026-12-01 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_file_images"
down_revision: str | None = "0013_base_model_catalogue"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("files", sa.Column("images", sa.Integer(), server_default="0", nullable=False))
    op.add_column("files", sa.Column("image_examples", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("files", "image_examples")
    op.drop_column("files", "images")
