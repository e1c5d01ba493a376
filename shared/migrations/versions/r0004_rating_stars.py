"""a rating's stars (1-5, `/rl 4`), stored beside its thumb

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ratings", sa.Column("stars", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ratings") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("stars")
