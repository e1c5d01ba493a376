"""Starting a training run: one queued job per model when the rule says so (shared/runs.py), never two.

The training lock (``train_lock_key``) says who holds the model's training: ``claiming:<token>`` for the
moment between claiming it and queueing the job, then the job's id until the run has ended. The token
is the claimer's own, so a claim redis-py resent after a lost reply still reads as this claimer's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import redis
from rq import Queue

from rlfleet.shared import inbox
from rlfleet.shared.job_names import TRAIN_JOB, train_job_id
from rlfleet.shared.queue import TRAIN_QUEUE, TRAINING_BUSY, job_is_over, train_lock_key
from rlfleet.shared.redis_text import as_text
from rlfleet.shared.runs import ratings_until_run

from .context import Context

LOCK_TTL = 24 * 3600  # a training run longer than this is treated as dead
CLAIM_TTL = 60  # seconds a trigger may take from claiming the training lock to queueing the job
CLAIMING = "claiming:"  # the lock's value before the job has an id
RECHECK = 1.0  # seconds a drain trusts its own count of ratings until the next training run


def is_claim(holder: bytes | str) -> bool:
    """Whether the training lock's value is a claim (a trigger between claiming and queueing), not a job id."""
    return as_text(holder).startswith(CLAIMING)


def maybe_trigger(ctx: Context, conn: redis.Redis, force: bool = False) -> str | None:
    """Queue one training run when pending ratings reach the threshold, unless an admin paused automatic
    training; never two for one model. ``force``: an explicit ``train``, held back by neither."""
    if not force and (ratings_until_run(ctx.store, ctx.slug, ctx.cfg.train.threshold)
                      or ctx.store.training_paused(ctx.slug)):
        return None
    pending = ctx.store.pending_count(ctx.slug)
    if force and not ctx.store.pending_ratings(ctx.slug, 1):
        return "nothing to train on: no pending ratings"
    key, token = train_lock_key(ctx.slug), f"{CLAIMING}{uuid.uuid4().hex}"
    # A claim lives only for the moment between claiming and queueing: a worker killed in between
    # must not block training for a day (no job id to check it against); the job's id then holds it.
    if not inbox.claim(conn, key, token, CLAIM_TTL):
        holder = conn.get(key)
        # (None: it expired just now, so nobody holds it)
        if holder is not None and (is_claim(holder) or not job_is_over(conn, as_text(holder))):
            return TRAINING_BUSY
        conn.delete(key)  # the worker holding it died: take over
        if not inbox.claim(conn, key, token, CLAIM_TTL):
            return TRAINING_BUSY
    run_id = ctx.store.create_run(ctx.slug)
    job_id = train_job_id(ctx.slug, run_id)
    conn.set(key, job_id.encode(), ex=LOCK_TTL)
    Queue(TRAIN_QUEUE, connection=conn).enqueue(
        TRAIN_JOB, run_id, ctx.slug, job_id=job_id, job_timeout=LOCK_TTL, result_ttl=7 * 24 * 3600,
        failure_ttl=7 * 24 * 3600, description=f"train {ctx.slug} run {run_id}",
    )
    return f"training run {run_id} queued on {pending} ratings"


@dataclass
class Countdown:
    """``maybe_trigger`` for one drain: ratings until the next run are looked up once, counted down by
    the ratings the drain adds, and looked up again when they may have run out or after ``RECHECK``
    seconds (a run that consumed ratings, an import). Every miscount is on the early side (a re-rating
    counts as a new rating, an undo is not counted back), so it never looks up too late: two
    transactions fewer per batch."""

    need: int = 0
    checked: float = float("-inf")

    def __call__(self, ctx: Context, conn: redis.Redis, new_ratings: int) -> str | None:
        self.need -= new_ratings
        if self.need > 0 and time.monotonic() - self.checked < RECHECK:
            return None
        self.need, self.checked = ratings_until_run(ctx.store, ctx.slug, ctx.cfg.train.threshold), time.monotonic()
        return maybe_trigger(ctx, conn) if self.need == 0 else None
