"""``rlfleet status``: one dict, a stable contract (documented in the README), built from the store,
the adapter registry and Redis; the worker also publishes it to a Redis key for bots to read."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import redis
from rq import Queue

from . import durability, inbox
from .bothealth import bots_status
from .config import Config
from .queue import TRAIN_QUEUE, progress_key, push_key, status_key, train_lock_key
from .registry import AdapterRegistry
from .store import Store
from .workers import live_workers


def _iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    # SQLite hands back naive datetimes; every time we store is UTC, so say so.
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).isoformat()


def training_state(store: Store, conn: redis.Redis | None, slug: str) -> dict:
    run = store.latest_run(slug)
    out: dict = {"state": "idle", "error": None, "run_id": None, "progress": None}
    if run is None:
        return out
    out["run_id"] = run.id
    if run.state in ("queued", "running"):
        alive = conn is None or conn.exists(train_lock_key(slug))
        if alive:
            out["state"] = run.state
        else:  # its worker died and nothing holds the run: say so instead of "running" forever
            out["state"], out["error"] = "failed", "the training worker stopped during the run"
    elif run.state == "failed":
        out["state"], out["error"] = "failed", run.error
    elif run.state == "rejected":  # trained, but the gate kept it from being served
        out["state"], out["error"] = "failed", f"{run.version} was not promoted: {run.error}"
    if conn is not None and out["state"] == "running":
        raw = conn.hgetall(progress_key(slug))
        if raw:
            p = {k.decode(): v.decode() for k, v in raw.items()}
            out["progress"] = {
                "phase": p.get("phase"),
                "step": int(p.get("step", 0)),
                "total": int(p.get("total", 0)),
                "tokens_per_s": float(p.get("tokens_per_s", 0)),
                "version": p.get("version"),
            }
    return out


def build_status(cfg: Config, store: Store, conn: redis.Redis | None, slug: str) -> dict:
    counts = store.counts(slug)
    ema, lineage = store.baseline(slug)
    registry = AdapterRegistry(cfg.adapters_root, slug)
    versions = [
        {
            "version": v.version,
            "status": v.status,
            "created": _iso(v.created),
            "parent": v.parent,
            "metrics": v.metrics or {},
        }
        for v in store.versions(slug)
    ]
    queue = {"events": 0, "train": 0, "dead_letters": 0}
    workers = 0
    if conn is not None:
        queue = {
            "events": inbox.pending(conn),  # not the drain job itself: one waiting rating is 1, not 2
            "train": Queue(TRAIN_QUEUE, connection=conn).count,
            "dead_letters": conn.llen(inbox.DEAD),
        }
        workers = len(live_workers(conn))  # not the registrations of dead ones
    return {
        "model": cfg.model,
        "model_slug": slug,
        "ratings": {"total": counts.total, "good": counts.good, "bad": counts.bad, "pending": counts.pending},
        "threshold": cfg.train.threshold,
        "preset": cfg.train.preset,
        "ema": ema if ema is not None else 0.0,
        "ema_seeded": ema is not None,
        "lineage": lineage,
        "adapter": {"current": registry.current(), "versions": versions},
        "training": training_state(store, conn, slug),
        "queue": queue,
        "workers": workers,
        "push": push_results(conn, slug),
        "bots": bots_status(cfg, conn),
        "durability": durability.check(conn).as_dict() if conn is not None else None,
    }


def push_results(conn: redis.Redis | None, slug: str) -> list[dict]:
    """The last push to each inference server (worker/push.py), oldest target name first."""
    if conn is None:
        return []
    raw = conn.hgetall(push_key(slug))
    return [json.loads(v) for _, v in sorted(raw.items())]


def publish_snapshot(cfg: Config, store: Store, conn: redis.Redis, slug: str) -> None:
    conn.set(status_key(slug), json.dumps(build_status(cfg, store, conn, slug)), ex=24 * 3600)
