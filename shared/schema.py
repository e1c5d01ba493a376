"""Tables (docs/data-layout.md). Changes go through an Alembic migration in ``shared/migrations``."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import cast

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Table, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


def table_of(model: type[Base]) -> Table:
    """The Table ``model`` maps. SQLAlchemy types ``__table__`` as any FROM clause (a class may map a
    join or a subquery); each of ours maps one Table."""
    return cast(Table, model.__table__)


class ProcessedEvent(Base):
    """One row per event applied: the idempotency record, written in the same transaction as the effect."""

    __tablename__ = "processed_events"
    event_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CaptureRow(Base):
    __tablename__ = "captures"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(256), unique=True)
    source: Mapped[str] = mapped_column(String(32))
    conversation: Mapped[str] = mapped_column(String(256))
    message_ref: Mapped[str | None] = mapped_column(String(256))
    owner: Mapped[str] = mapped_column(String(256))
    prompt: Mapped[list] = mapped_column(JSON)
    response: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(256))
    adapter_version: Mapped[str | None] = mapped_column(String(64))
    behaviour_logprobs: Mapped[list | None] = mapped_column(JSON)
    behaviour_token_ids: Mapped[list | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(16))  # stop | length | None (events.FinishReason)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (
        Index("ix_captures_ref", "message_ref"),
        Index("ix_captures_conv_owner", "conversation", "owner", "created"),
    )


class RatingRow(Base):
    """A rating. ``state``: active | replaced | undone. ``run_id``: the run that trained on it.

    ``retract_run_id`` is set when an already-trained rating was undone or replaced and a later run
    applied the opposite update, so that nothing trained on is stranded.
    """

    __tablename__ = "ratings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(256), unique=True)
    capture_id: Mapped[str] = mapped_column(ForeignKey("captures.id", ondelete="CASCADE"))
    train_model: Mapped[str] = mapped_column(String(256))
    actor: Mapped[str] = mapped_column(String(256))
    source: Mapped[str] = mapped_column(String(32))
    value: Mapped[int] = mapped_column(Integer)
    comment: Mapped[str | None] = mapped_column(Text)
    stars: Mapped[int | None] = mapped_column(Integer)  # 1-5 when rated in stars (/rl 4), beside the thumb
    # An agent's step in an environment (source gym): the step's own reward, its thumb the sign of the
    # return from it. Such a rating trains only in its agent's runs, with the episode's returns.
    reward: Mapped[float | None] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16), default="active")
    adapter_version: Mapped[str | None] = mapped_column(String(64))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("train_runs.id"))
    advantage: Mapped[float | None] = mapped_column(Float)
    retract_run_id: Mapped[int | None] = mapped_column(ForeignKey("train_runs.id"))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    changed: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (
        Index("ix_ratings_pending", "train_model", "state", "run_id"),
        Index("ix_ratings_actor", "actor", "created"),
        Index("ix_ratings_capture_state", "capture_id", "state"),  # a capture's active rating, per event
    )


class TrainRun(Base):
    """state: queued | running | succeeded | failed | rejected | stale."""

    __tablename__ = "train_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16), default="queued")
    error: Mapped[str | None] = mapped_column(Text)
    version: Mapped[str | None] = mapped_column(String(64))
    parent: Mapped[str | None] = mapped_column(String(64))
    lineage: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict | None] = mapped_column(JSON)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AdapterVersion(Base):
    """status: active | candidate | rejected | rolled_back | stale (the files live in the registry)."""

    __tablename__ = "adapter_versions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(256))
    version: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    parent: Mapped[str | None] = mapped_column(String(64))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("train_runs.id"))
    lineage: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict | None] = mapped_column(JSON)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (UniqueConstraint("model", "version"),)


class Baseline(Base):
    """Per model: the reward EMA, how many ratings moved it, the lineage counter bumped by reset, and
    whether an admin paused automatic training (``rlfleet pause``)."""

    __tablename__ = "baselines"
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    ema: Mapped[float | None] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer, default=0)
    lineage: Mapped[int] = mapped_column(Integer, default=0)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
