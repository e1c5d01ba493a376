"""whether an admin paused automatic training for a model (`rlfleet pause` / `resume`)

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("baselines", sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("baselines") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("paused")
