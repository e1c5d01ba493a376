"""The events drain: one RQ job that applies the inbox's events in batches until the inbox is empty
(shared/inbox.py says why events travel that way, worker/drain.py how one batch is applied).

A batch's commit does not wait for the disk: a sync thread (worker/syncer.py) puts the commits on disk
beside the next batches, and only then does Redis let go of their events. The status snapshot is
refreshed from a thread of its own, so the events arriving meanwhile do not wait behind its queries.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis
from rq import Queue

from rlfleet.shared import inbox
from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.events import Capture, Command, Rating, Undo, parse_event
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.queue import EVENTS_QUEUE, queue_drain
from rlfleet.shared.status import publish_snapshot

from .context import Context, context
from .drain import apply_batch
from .syncer import Syncer
from .trigger import Countdown, maybe_trigger
from .version_commands import run_command

log = logging.getLogger("rlfleet.worker")

DRAIN_SECONDS = 30.0  # then a fresh drain job takes over: other jobs on the queue get a turn
# An empty inbox is waited on this long before the drain lets go: under a steady stream (a few events a
# second and up) the next one then wakes the drain at once, not a new RQ job (the tail of the latency).
DRAIN_LINGER = 0.25
SNAPSHOT_EVERY = 2.0  # seconds between status snapshots during a long drain


class _Snapshots:
    """Status stays fresh during a long drain: published every ``SNAPSHOT_EVERY`` seconds from a thread
    of its own, so the events arriving meanwhile do not wait behind its queries."""

    def __init__(self, ctx: Context, conn: redis.Redis) -> None:
        self.ctx, self.conn, self.stop = ctx, conn, threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlfleet-status-snapshot", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(SNAPSHOT_EVERY):
            try:
                publish_snapshot(self.ctx.cfg, self.ctx.store, self.conn, self.ctx.slug)
            except Exception as exc:  # the drain's own last snapshot says what is wrong, if it lasts
                log.warning("status snapshot failed: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> _Snapshots:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(SNAPSHOT_EVERY)  # a snapshot stuck on a dead connection must not hold the drain


def drain(ctx: Context, conn: redis.Redis, me: str) -> JobResult:
    """Apply the inbox's events as drain job ``me`` until the inbox is empty, or hand it over to a new
    drain job after ``DRAIN_SECONDS``."""
    started = last_work = time.monotonic()
    applied = 0
    trigger = Countdown()
    bell = inbox.Doorbell(conn)
    with _Snapshots(ctx, conn), contextlib.closing(bell), Syncer(ctx.store, conn) as syncer:
        batch = inbox.take(conn, me, first=True)
        while True:
            if batch is None:
                return JobResult.done("another drain owns the inbox", applied=applied)
            if not batch.items:
                idle = time.monotonic() - last_work
                if idle < DRAIN_LINGER:
                    bell.wait(DRAIN_LINGER - idle)
                else:
                    syncer.sync_now()  # nothing of this drain's may wait for a sync once it lets go
                    if inbox.release(conn, me):
                        break
                batch = inbox.take(conn, me)
                continue
            # the commit does not wait for the disk: the syncer does, beside the next batches
            results = _wire(apply_batch(ctx, conn, batch.items, trigger, durable=False))
            applied += len(results)
            last_work = time.monotonic()
            if last_work - started > DRAIN_SECONDS:
                inbox.answer(conn, results, batch, synced=False)
                syncer.sync_now()
                successor = inbox.hand_over(conn, me)
                if successor:
                    queue_drain(conn, successor)
                break
            batch = inbox.answer_and_take(conn, results, batch, me, synced=False)
            syncer.nudge()
    publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)
    return JobResult.done(f"applied {applied} events", applied=applied)


def _wire(results: dict[str, JobResult]) -> dict[str, dict]:
    return {event_id: r.to_dict() for event_id, r in results.items()}


def apply_one(ctx: Context, conn: redis.Redis, payload: str) -> JobResult:
    """One event as its own RQ job: how events travelled before the inbox. Kept so jobs queued by an
    earlier version still apply after an upgrade; new events go through the drain."""
    try:
        event = parse_event(payload)
        if isinstance(event, Capture):
            result = JobResult.from_dict(ctx.store.apply_capture(event).answer())
        elif isinstance(event, Rating):
            applied = ctx.store.apply_rating(event, ctx.train_model)
            result = JobResult.from_dict(applied.answer())
            if result.ok and not result.extra["duplicate"]:
                result = result.with_extra(training=maybe_trigger(ctx.scoped(applied.train_model or ctx.slug), conn))
        elif isinstance(event, Undo):
            result = JobResult.from_dict(ctx.store.apply_undo(event).answer())
        else:
            result = run_command(ctx, conn, event)
    except RlfleetError as exc:
        return JobResult.failed(str(exc))
    # The status snapshot costs more than applying a rating: under a burst only the event that
    # empties the queue publishes it (so the last word is always fresh); commands always do.
    if isinstance(event, Command) or not Queue(EVENTS_QUEUE, connection=conn).count:
        publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)
    return result


def warm_up() -> None:
    """Before the first event: open the store (migrations checked), read the config, import the jobs.
    Otherwise the first event after a worker starts waits a fifth of a second for all that."""
    import rlfleet.worker.jobs  # noqa: F401  (what RQ imports by name for the first job)

    ctx = context()
    ctx.store.apply_many([], ctx.slug)
    ctx.store.pending_count(ctx.slug)
