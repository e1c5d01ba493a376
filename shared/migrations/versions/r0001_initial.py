"""initial schema

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "processed_events",
        sa.Column("event_id", sa.String(256), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("created", TS, nullable=False),
    )
    op.create_table(
        "captures",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("event_id", sa.String(256), nullable=False, unique=True),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("conversation", sa.String(256), nullable=False),
        sa.Column("message_ref", sa.String(256)),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("prompt", sa.JSON, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("adapter_version", sa.String(64)),
        sa.Column("behaviour_logprobs", sa.JSON),
        sa.Column("behaviour_token_ids", sa.JSON),
        sa.Column("created", TS, nullable=False),
    )
    op.create_index("ix_captures_ref", "captures", ["message_ref"])
    op.create_index("ix_captures_conv_owner", "captures", ["conversation", "owner", "created"])
    op.create_table(
        "train_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("version", sa.String(64)),
        sa.Column("parent", sa.String(64)),
        sa.Column("lineage", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON),
        sa.Column("created", TS, nullable=False),
        sa.Column("started", TS),
        sa.Column("finished", TS),
    )
    op.create_table(
        "ratings",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(256), nullable=False, unique=True),
        sa.Column("capture_id", sa.String(256), sa.ForeignKey("captures.id", ondelete="CASCADE"), nullable=False),
        sa.Column("train_model", sa.String(256), nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("value", sa.Integer, nullable=False),
        sa.Column("comment", sa.Text),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("adapter_version", sa.String(64)),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("train_runs.id")),
        sa.Column("advantage", sa.Float),
        sa.Column("retract_run_id", sa.Integer, sa.ForeignKey("train_runs.id")),
        sa.Column("created", TS, nullable=False),
        sa.Column("changed", TS, nullable=False),
    )
    op.create_index("ix_ratings_pending", "ratings", ["train_model", "state", "run_id"])
    op.create_index("ix_ratings_actor", "ratings", ["actor", "created"])
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("parent", sa.String(64)),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("train_runs.id")),
        sa.Column("lineage", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON),
        sa.Column("created", TS, nullable=False),
        sa.UniqueConstraint("model", "version"),
    )
    op.create_table(
        "baselines",
        sa.Column("model", sa.String(256), primary_key=True),
        sa.Column("ema", sa.Float),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("lineage", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    for table in ("baselines", "adapter_versions", "ratings", "train_runs", "captures", "processed_events"):
        op.drop_table(table)
