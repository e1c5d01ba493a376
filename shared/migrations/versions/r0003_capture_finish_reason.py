"""how a captured answer ended: "stop" (the model ended it) or "length" (a length cap cut it off)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("captures", sa.Column("finish_reason", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("captures") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("finish_reason")
