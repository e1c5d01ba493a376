"""an environment's reward on a rated step of an agent (rlfleet.gym), beside its thumb

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ratings", sa.Column("reward", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ratings") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("reward")
