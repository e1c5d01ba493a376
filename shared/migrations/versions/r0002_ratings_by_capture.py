"""ratings by capture: the active rating of an answer is looked up by every rating event

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_ratings_capture_state", "ratings", ["capture_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_ratings_capture_state", table_name="ratings")
