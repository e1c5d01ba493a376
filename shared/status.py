"""``rlfleet status``: one :class:`Status`, gathered here from the store, the adapter registry and Redis,
and nowhere else. Its wire form (``to_dict``: the JSON of ``rlfleet status --json``, documented in the
README) is what every front end renders; the worker also publishes it to a Redis key for bots to read."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue

from . import durability, inbox, scopes
from .bothealth import bots_status
from .config import Config
from .queue import TRAIN_QUEUE, QueueHandle, inline_holder_alive, progress_key, push_key, status_key, train_lock_key
from .registry import AdapterRegistry
from .schema import AdapterVersion
from .store import Store
from .workers import live_workers


def _iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    # SQLite hands back naive datetimes; every time we store is UTC, so say so.
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).isoformat()


@dataclass(frozen=True)
class TrainingProgress:
    """The running run's last report (worker/orchestrate.py writes it to ``progress_key``)."""

    phase: str | None
    step: int
    total: int
    tokens_per_s: float
    version: str | None

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> TrainingProgress:
        """From the hash's raw bytes."""
        p = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(p.get("phase"), int(p.get("step", 0)), int(p.get("total", 0)), float(p.get("tokens_per_s", 0)),
                   p.get("version"))

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "step": self.step, "total": self.total, "tokens_per_s": self.tokens_per_s,
                "version": self.version}


@dataclass(frozen=True)
class TrainingState:
    state: str = "idle"  # idle, queued, running or failed (a rejected version says so here too; an idle
    # one's error says why the last run trained nothing)
    error: str | None = None
    run_id: int | None = None
    progress: TrainingProgress | None = None
    paused: bool = False  # an admin paused automatic training: no run starts by itself (`train` still does)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "error": self.error, "run_id": self.run_id,
                "progress": self.progress.to_dict() if self.progress else None, "paused": self.paused}


def read_training(store: Store, conn: redis.Redis | None, slug: str) -> TrainingState:
    paused = store.training_paused(slug)
    run = store.latest_run(slug)
    if run is None:
        return TrainingState(paused=paused)
    state, error = "idle", None
    if run.state in ("queued", "running"):
        holder = conn.get(train_lock_key(slug)) if conn is not None else b"?"
        alive = bool(holder) and inline_holder_alive(holder) is not False
        if alive:
            state = run.state
        else:  # its worker died and nothing holds the run: say so instead of "running" forever
            state, error = "failed", "the training worker stopped during the run"
    elif run.state == "failed":
        state, error = "failed", run.error
    elif run.state == "rejected":  # trained, but the gate kept it from being served
        state, error = "failed", f"{run.version} was not promoted: {run.error}"
    elif run.state == "skipped" and run.error:  # nothing to learn from its ratings: say why while idle
        error = run.error
    progress = None
    if conn is not None and state == "running":
        raw = conn.hgetall(progress_key(slug))
        progress = TrainingProgress.from_hash(raw) if raw else None
    return TrainingState(state, error, run.id, progress, paused)


def training_state(store: Store, conn: redis.Redis | None, slug: str) -> dict:
    """The ``training`` part of the status, in its wire form."""
    return read_training(store, conn, slug).to_dict()


@dataclass(frozen=True)
class RatingCounts:
    total: int
    good: int
    bad: int
    pending: int


@dataclass(frozen=True)
class VersionEntry:
    version: str
    status: str
    created: str | None
    parent: str | None
    metrics: dict[str, Any]

    @classmethod
    def of(cls, v: AdapterVersion) -> VersionEntry:
        return cls(v.version, v.status, _iso(v.created), v.parent, v.metrics or {})

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "status": self.status, "created": self.created, "parent": self.parent,
                "metrics": self.metrics}


@dataclass(frozen=True)
class QueueCounts:
    events: int = 0  # events handed over and not applied yet (not the drain job itself)
    train: int = 0
    dead_letters: int = 0


@dataclass(frozen=True)
class Status:
    model: str
    model_slug: str
    ratings: RatingCounts
    threshold: int
    preset: str
    ema: float | None  # None: not seeded yet (0.0 on the wire, with ema_seeded false)
    lineage: int
    current: str | None  # the adapter version being served; None: the base model
    versions: list[VersionEntry]
    training: TrainingState
    queue: QueueCounts
    workers: int  # live workers, not the registrations of dead ones
    push: list[dict] = field(default_factory=list)  # the last push to each target (worker/push.py)
    bots: dict[str, dict] = field(default_factory=dict)  # per bot (shared/bothealth.py)
    durability: dict | None = None  # what an acknowledgement is worth (shared/durability.py); None: no Redis
    scopes: dict[str, dict] = field(default_factory=dict)  # per scope key other than shared (shared/scopes.py)

    def to_dict(self) -> dict[str, Any]:
        r, q = self.ratings, self.queue
        return {
            "model": self.model,
            "model_slug": self.model_slug,
            "ratings": {"total": r.total, "good": r.good, "bad": r.bad, "pending": r.pending},
            "threshold": self.threshold,
            "preset": self.preset,
            "ema": self.ema if self.ema is not None else 0.0,
            "ema_seeded": self.ema is not None,
            "lineage": self.lineage,
            "adapter": {"current": self.current, "versions": [v.to_dict() for v in self.versions]},
            "training": self.training.to_dict(),
            "queue": {"events": q.events, "train": q.train, "dead_letters": q.dead_letters},
            "workers": self.workers,
            "push": self.push,
            "bots": self.bots,
            "durability": self.durability,
            "scopes": self.scopes,
        }


def gather_status(cfg: Config, store: Store, conn: redis.Redis | None, slug: str) -> Status:
    counts = store.counts(slug)
    ema, lineage = store.baseline(slug)
    queue, workers = QueueCounts(), 0
    if conn is not None:
        queue = QueueCounts(inbox.pending(conn), Queue(TRAIN_QUEUE, connection=conn).count, conn.llen(inbox.DEAD))
        workers = len(live_workers(conn))
    return Status(
        model=cfg.model,
        model_slug=slug,
        ratings=RatingCounts(counts.total, counts.good, counts.bad, counts.pending),
        threshold=cfg.train.threshold,
        preset=cfg.train.preset,
        ema=ema,
        lineage=lineage,
        current=AdapterRegistry(cfg.adapters_root, slug).current(),
        versions=[VersionEntry.of(v) for v in store.versions(slug)],
        training=read_training(store, conn, slug),
        queue=queue,
        workers=workers,
        push=push_results(conn, slug),
        bots=bots_status(cfg, conn),
        durability=durability.check(conn).as_dict() if conn is not None else None,
        scopes={} if scopes.is_scoped(slug) else {
            scopes.split(name)[1]: scope_status(cfg, store, conn, name) for name in store.scope_lineages(slug)},
    )


def scope_status(cfg: Config, store: Store, conn: redis.Redis | None, name: str) -> dict:
    """One scope's own figures, as `status --json` shows them under ``scopes``."""
    c = store.counts(name)
    return {"lineage": name, "ratings": {"total": c.total, "good": c.good, "bad": c.bad, "pending": c.pending},
            "adapter": {"current": AdapterRegistry(cfg.adapters_root, name).current(),
                        "versions": len(store.versions(name))},
            "training": read_training(store, conn, name).to_dict()}


def build_status(cfg: Config, store: Store, conn: redis.Redis | None, slug: str) -> dict:
    """The status in its wire form: what ``rlfleet status --json`` prints and the snapshot holds."""
    return gather_status(cfg, store, conn, slug).to_dict()


def status_dict(cfg: Config, handle: QueueHandle | None, scope: str | None = None) -> dict:
    """The status of this data dir's model, as ``rlfleet status`` and the chat's ``/rl status`` show it;
    of one scope's lineage with ``scope`` (a scope key: shared/scopes.py)."""
    from .models import model_slug

    slug = scopes.lineage(model_slug(cfg.model), scope or scopes.SHARED)
    return build_status(cfg, Store(cfg.db_url), handle.redis if handle else None, slug)


def push_results(conn: redis.Redis | None, slug: str) -> list[dict]:
    """The last push to each inference server (worker/push.py), oldest target name first."""
    if conn is None:
        return []
    raw = conn.hgetall(push_key(slug))
    return [json.loads(v) for _, v in sorted(raw.items())]


def publish_snapshot(cfg: Config, store: Store, conn: redis.Redis, slug: str) -> None:
    conn.set(status_key(slug), json.dumps(build_status(cfg, store, conn, slug)), ex=24 * 3600)
