"""Applying one batch of inbox events (shared/inbox.py): in order, data events in one transaction each
run of them, commands one by one between them, and an answer for every event.

An event that breaks something of its own is retried behind the others and dead-lettered after
``inbox.MAX_ATTEMPTS``; a database that is down or locked fails the whole batch instead (the drain
job is retried, and TAKEN keeps the batch meanwhile), so an outage never dead-letters anything.
"""

from __future__ import annotations

import logging
import uuid

import redis
from sqlalchemy.exc import InterfaceError, OperationalError

from rlfleet.shared import inbox
from rlfleet.shared.applied import Applied
from rlfleet.shared.errors import BadInput, RlfleetError
from rlfleet.shared.events import Capture, Command, Rating, Undo, parse_event
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.status import publish_snapshot

from .context import Context
from .trigger import Countdown, maybe_trigger
from .version_commands import run_command

log = logging.getLogger("rlfleet.worker")
DATABASE_DOWN = (OperationalError, InterfaceError)
DataEvent = Capture | Rating | Undo


def apply_batch(ctx: Context, conn: redis.Redis, items: list[bytes], trigger: Countdown,
                durable: bool = True) -> dict[str, JobResult]:
    """Each applied event's answer by event id. Events retried later have none yet. ``trigger`` is
    called once per run of data events that added ratings, with how many it added. Not ``durable``:
    the runs' commits do not wait for the disk (the caller syncs; shared/dbsync.py)."""
    results: dict[str, JobResult] = {}
    run: list[tuple[bytes, DataEvent]] = []

    def apply_run() -> None:
        if run:
            results.update(_apply_run(ctx, conn, run, trigger, durable))
            run.clear()

    for raw in items:
        try:
            ev = parse_event(raw)
        except BadInput as exc:  # not from one of our producers: keep it for a person to look at
            log.warning("dead-lettered an unreadable inbox entry: %s", exc)
            inbox.dead_letter(conn, raw, str(exc))
            continue
        if isinstance(ev, Command):
            apply_run()  # the command sees every event sent before it
            results[ev.event_id] = _command(ctx, conn, ev)
        else:
            run.append((raw, ev))
    apply_run()
    return results


def _command(ctx: Context, conn: redis.Redis, cmd: Command) -> JobResult:
    # at most once: a drain killed after running it must not roll back twice when its batch is repeated
    if not inbox.claim(conn, inbox.command_key(cmd.event_id), uuid.uuid4().hex, 7 * 24 * 3600):
        return JobResult.done(f"/rl {cmd.name} was already carried out", duplicate=True)
    try:
        return run_command(ctx, conn, cmd)
    except RlfleetError as exc:  # a refusal found on the way (a version name that is not one, say)
        return JobResult.failed(str(exc))
    except DATABASE_DOWN:
        raise
    except Exception as exc:
        log.exception("command %s failed", cmd.name)
        return JobResult.failed(f"the worker failed on /rl {cmd.name}: {type(exc).__name__}: {exc}")


def _apply_run(ctx: Context, conn: redis.Redis, run: list[tuple[bytes, DataEvent]],
               trigger: Countdown, durable: bool) -> dict[str, JobResult]:
    try:
        applied: list[Applied | None] = list(ctx.store.apply_many([ev for _, ev in run], ctx.train_model,
                                                                  durable=durable))
    except DATABASE_DOWN:
        raise
    except Exception:  # one event breaks the batch (or a concurrent writer had one): one at a time
        applied = [_apply_alone(ctx, conn, raw, ev) for raw, ev in run]
    out: dict[str, JobResult] = {}
    last_new: dict[str, tuple[str, int]] = {}  # per lineage: its last new rating, and how many were new
    for (_, ev), a in zip(run, applied, strict=True):
        if a is None:
            continue  # retried later
        if not a.ok:  # a refusal is its reason, nothing more
            out[ev.event_id] = JobResult.failed(a.message)
            continue
        answer = a.answer()
        if isinstance(ev, Rating):
            answer["training"] = None  # the trigger's word, for the last new rating of the run
            if not a.duplicate:
                lineage = a.train_model or ctx.slug
                last_new[lineage] = (ev.event_id, last_new.get(lineage, ("", 0))[1] + 1)
        out[ev.event_id] = JobResult.from_dict(answer)
    # the threshold is checked once per batch and lineage, not once per rating
    for lineage, (event_id, new_ratings) in last_new.items():
        if lineage == ctx.slug:
            word = trigger(ctx, conn, new_ratings)
        else:  # a scope's: its own threshold, and its own status for `/rl status` (shared/scopes.py)
            word = maybe_trigger(ctx.scoped(lineage), conn)
            publish_snapshot(ctx.cfg, ctx.store, conn, lineage)
        out[event_id] = out[event_id].with_extra(training=word)
    return out


def _apply_alone(ctx: Context, conn: redis.Redis, raw: bytes, ev: DataEvent) -> Applied | None:
    try:
        return ctx.store.apply_one(ev, ctx.train_model, refuse=False)
    except DATABASE_DOWN:
        raise
    except Exception as exc:
        attempts = inbox.failed_attempt(conn, ev.event_id)
        log.exception("event %s (%s) failed, attempt %d of %d", ev.event_id, ev.type, attempts, inbox.MAX_ATTEMPTS)
        if attempts < inbox.MAX_ATTEMPTS:
            inbox.retry_later(conn, raw)
            return None
        why = f"{type(exc).__name__}: {exc}"
        inbox.dead_letter(conn, raw, why)
        return Applied(False, f"the worker failed on it {attempts} times and set it aside: {why}")
