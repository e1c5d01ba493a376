"""The store: every state change a worker makes, each in one transaction with its idempotency record.

SQLite (WAL) by default, PostgreSQL by ``DATABASE_URL``. The schema is migrated with Alembic on open.
Functions here take typed events and return small result dataclasses; nothing here knows about Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Connection, Engine, bindparam, create_engine, event, func, insert, or_, select, update
from sqlalchemy.exc import DisconnectionError, IntegrityError
from sqlalchemy.orm import Session, defer, sessionmaker

from . import dbsync
from .config import redact_url
from .errors import BadInput, ConfigError, NotFound
from .events import PLATFORMS, Capture, Rating, Undo
from .schema import AdapterVersion, Baseline, CaptureRow, ProcessedEvent, RatingRow, TrainRun

MIGRATIONS = Path(__file__).with_name("migrations")
_ENGINES: dict[str, Engine] = {}
_DEFERRED_ENGINES: dict[str, Engine] = {}
_MIGRATED: set[str] = set()  # URLs brought to head by this process: once is enough
PING_AFTER_IDLE_S = 1.0


def _utc(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _engine(url: str, deferred: bool = False) -> Engine:
    """The process's engine for ``url``; ``deferred``: a second one whose commits do not wait for the
    disk (shared/dbsync.py)."""
    engines = _DEFERRED_ENGINES if deferred else _ENGINES
    if url in engines:
        return engines[url]
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = create_engine(url, future=True, connect_args=dbsync.connect_args(url, deferred))
    except Exception as exc:  # bad URL or missing driver: one line with the fix
        raise ConfigError(f"cannot use DATABASE_URL: {exc}") from None
    _ping_when_idle(engine)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # WAL lets readers (status) run beside the writer (worker)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=10000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA synchronous={dbsync.sqlite_synchronous(deferred)}")
            cur.close()

    engines[url] = engine
    return engine


def forget(url: str) -> None:
    """Close this process's engines for ``url`` (a database about to be dropped)."""
    _MIGRATED.discard(url)
    for engines in (_ENGINES, _DEFERRED_ENGINES):
        engine = engines.pop(url, None)
        if engine is not None:
            engine.dispose()


def _ping_when_idle(engine: Engine) -> None:
    """``pool_pre_ping``, for connections idle a while only: a drain busy with batches would otherwise
    pay a round trip per transaction. A connection the server dropped (a restart) is found by the ping
    on its first use after the pause and replaced; one dropped mid-stream fails that transaction,
    which the drain treats as the database being down, as for any outage, and the pool reconnects."""

    @event.listens_for(engine, "checkin")
    def _used(_dbapi_conn, record) -> None:
        record.info["returned"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn, record, _proxy) -> None:
        if time.monotonic() - record.info.get("returned", float("-inf")) < PING_AFTER_IDLE_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception:
            alive = False
        if not alive:
            raise DisconnectionError("the pooled connection is gone")  # the pool discards it and reconnects


def migrate(engine: Engine) -> None:
    from alembic import command
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # Processes start together (chat, its workers, a CLI command): one migrates, the others wait
    # and then find the schema at head. SQLite runs each DDL statement in its own transaction, so
    # without the lock two of them interleave ("table ... already exists").
    with _migration_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7155172026)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    db = engine.url.database if engine.dialect.name == "sqlite" else None
    if not db or db == ":memory:":
        yield
        return
    import fcntl

    with open(f"{db}.migrate-lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Applied:
    """What a job did, returned to whoever enqueued it (the CLI prints ``message``)."""

    ok: bool
    message: str
    duplicate: bool = False
    capture_id: str | None = None
    rating_id: int | None = None
    value: int | None = None


@dataclass
class _Batch:
    """What one transaction knows while it applies events: the event ids applied (before, or in this
    transaction), and the active rating of each capture it has looked at (None: none)."""

    done: set[str]
    active: dict[str, RatingRow | None]
    # the prefetched captures: the session's identity map holds its objects weakly, this keeps them there
    held: list[CaptureRow]
    fresh: RatingRow | None = None  # the rating row the current event added


@dataclass(frozen=True)
class Counts:
    total: int
    good: int
    bad: int
    pending: int


class Store:
    def __init__(self, url: str, *, migrate_schema: bool = True) -> None:
        self.url = url
        self.engine = _engine(url)
        if migrate_schema and url not in _MIGRATED:
            try:
                migrate(self.engine)
                _MIGRATED.add(url)
            except IntegrityError:
                pass  # another process migrated at the same moment
            except Exception as exc:
                if "OperationalError" in type(exc).__name__ or "connect" in str(exc).lower():
                    raise ConfigError(f"cannot reach the database ({redact_url(url)}): {_first(exc)}") from None
                raise
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._deferred: sessionmaker | None = None

    @contextmanager
    def session(self, durable: bool = True) -> Iterator[Session]:
        """One transaction; not ``durable``: its commit does not wait for the disk (``sync`` does)."""
        if durable:
            maker = self._sessions
        else:
            if self._deferred is None:
                self._deferred = sessionmaker(_engine(self.url, deferred=True), expire_on_commit=False)
            maker = self._deferred
        with maker.begin() as s:
            yield s

    # ---- events -------------------------------------------------------------------------------

    # Each ``_apply_*`` works inside the caller's transaction and checks everything before it writes
    # anything: a refusal (BadInput/NotFound) leaves the session as it found it, so one transaction can
    # apply a whole batch of events (``apply_many``) and still refuse some of them.

    @staticmethod
    def _claim(s: Session, event_id: str, kind: str, b: _Batch) -> None:
        b.done.add(event_id)
        s.add(ProcessedEvent(event_id=event_id, kind=kind))

    def _active(self, s: Session, capture_id: str, b: _Batch) -> RatingRow | None:
        if capture_id not in b.active:
            b.active[capture_id] = s.scalars(
                select(RatingRow).where(RatingRow.capture_id == capture_id, RatingRow.state == "active")
            ).first()
        return b.active[capture_id]

    @staticmethod
    def _prefetch(s: Session, events: Sequence[Capture | Rating | Undo]) -> _Batch:
        """Two queries instead of three per event: which events were applied before, and the captures
        addressed by id (into the session's identity map, so ``s.get`` finds them without SQL) joined
        with their active ratings (one round trip fewer per batch than asking for those apart)."""
        ids = [ev.event_id for ev in events]
        done = set(s.scalars(select(ProcessedEvent.event_id).where(ProcessedEvent.event_id.in_(ids))))
        targets = {ev.target for ev in events if isinstance(ev, Rating | Undo) and ev.target not in (None, "last")}
        found: list[CaptureRow] = []
        active: dict[str, RatingRow | None] = {}
        if targets:
            for cap, row in s.execute(
                select(CaptureRow, RatingRow)
                .outerjoin(RatingRow, (RatingRow.capture_id == CaptureRow.id) & (RatingRow.state == "active"))
                .where(CaptureRow.id.in_(targets))
                # a rating needs none of the answer's bulk (its prompt, its log-probs: kilobytes of JSON)
                .options(defer(CaptureRow.prompt), defer(CaptureRow.behaviour_logprobs),
                         defer(CaptureRow.behaviour_token_ids))
            ):
                if cap.id not in active:
                    found.append(cap)
                if row is not None or cap.id not in active:
                    active[cap.id] = row
        return _Batch(done, active, found)

    def _apply_capture(self, s: Session, ev: Capture, b: _Batch) -> Applied:
        if ev.event_id in b.done:  # applied before: the repeat is ignored
            return Applied(True, "already recorded", duplicate=True, capture_id=ev.capture_id)
        if s.get(CaptureRow, ev.capture_id) is not None:
            raise BadInput(f"capture id {ev.capture_id} is already taken")
        self._claim(s, ev.event_id, "capture", b)
        s.add(CaptureRow(**_capture_values(ev)))
        return Applied(True, f"captured {ev.capture_id}", capture_id=ev.capture_id)

    def _resolve_target(
        self, s: Session, target: str, actor: str, conversation: str | None, source: str, any_owner: bool = False
    ) -> CaptureRow:
        """The capture a rating or undo addresses: ``last`` (the actor's latest in the conversation, or
        anyone's when ``any_owner``: allowlisted raters), a capture id, or a platform message ref (looked
        up among that platform's captures only: refs of different platforms may collide)."""
        if target == "last":
            q = select(CaptureRow)
            if not any_owner:
                q = q.where(CaptureRow.owner == actor)
            if conversation:
                q = q.where(CaptureRow.conversation == conversation)
            row = s.scalars(q.order_by(CaptureRow.created.desc(), CaptureRow.id.desc()).limit(1)).first()
            if row is None:
                raise NotFound("nothing of yours to rate here: no captured answer yet")
            return row
        row = s.get(CaptureRow, target)
        if row is None:
            q = select(CaptureRow).where(CaptureRow.message_ref == target)
            if source in PLATFORMS:
                q = q.where(CaptureRow.source == source)
            if conversation:
                q = q.where(CaptureRow.conversation == conversation)
            row = s.scalars(q.order_by(CaptureRow.created.desc()).limit(1)).first()
        if row is None:
            raise NotFound(f"no captured answer with id or message ref {target!r}")
        return row

    def find_capture(self, source: str, conversation: str, message_ref: str) -> tuple[str, str] | None:
        """``(capture_id, owner)`` of the answer a bot posted as ``message_ref``, or None."""
        with self.session() as s:
            row = s.execute(
                select(CaptureRow.id, CaptureRow.owner)
                .where(CaptureRow.source == source, CaptureRow.conversation == conversation,
                       CaptureRow.message_ref == message_ref)
                .order_by(CaptureRow.created.desc())
                .limit(1)
            ).first()
        return (row[0], row[1]) if row else None

    def _apply_rating(self, s: Session, ev: Rating, train_model: str, b: _Batch) -> Applied:
        if ev.event_id in b.done:  # applied before: the repeat is ignored
            return Applied(True, "already recorded", duplicate=True)
        anyones = ev.scope == "any"  # what the ingress's permission decision granted
        cap = self._resolve_target(s, ev.target, ev.actor, ev.conversation, ev.source, anyones)
        if not anyones and cap.owner != ev.actor:
            raise NotFound("nothing of yours to rate here")
        current = self._active(s, cap.id, b)
        self._claim(s, ev.event_id, "rating", b)
        now = datetime.now(timezone.utc)
        if current is not None and current.value == ev.value and current.comment == ev.comment:
            if current.id is None:  # added earlier in this batch: its id comes with the flush
                b.fresh = current
            return Applied(True, "already rated that way", capture_id=cap.id, rating_id=current.id, value=ev.value)
        if current is not None:
            current.state = "replaced"
            current.changed = now
        row = RatingRow(
            event_id=ev.event_id,
            capture_id=cap.id,
            train_model=train_model,
            actor=ev.actor,
            source=ev.source,
            value=ev.value,
            comment=ev.comment,
            state="active",
            adapter_version=cap.adapter_version,
            created=now,
            changed=now,
        )
        s.add(row)
        b.active[cap.id] = row
        b.fresh = row
        return Applied(True, _rated(ev.value, current is not None, cap.response), capture_id=cap.id, value=ev.value)

    def _apply_undo(self, s: Session, ev: Undo, b: _Batch) -> Applied:
        if ev.event_id in b.done:  # applied before: the repeat is ignored
            return Applied(True, "already recorded", duplicate=True)
        q = select(RatingRow).where(RatingRow.actor == ev.actor, RatingRow.state == "active")
        if ev.target is not None:
            cap = self._resolve_target(s, ev.target, ev.actor, ev.conversation, ev.source, any_owner=True)
            q = q.where(RatingRow.capture_id == cap.id)
            if ev.value is not None:
                q = q.where(RatingRow.value == ev.value)
        row = s.scalars(q.order_by(RatingRow.created.desc(), RatingRow.id.desc()).limit(1)).first()
        if row is None:
            raise NotFound("nothing of yours to undo" + (" on that answer" if ev.target else ""))
        self._claim(s, ev.event_id, "undo", b)
        row.state = "undone"
        b.active[row.capture_id] = None
        row.changed = datetime.now(timezone.utc)
        word = "good" if row.value > 0 else "bad"
        return Applied(True, f"undid your {word} rating", capture_id=row.capture_id, rating_id=row.id,
                       value=row.value)

    def _apply(self, s: Session, ev: Capture | Rating | Undo, train_model: str, b: _Batch) -> Applied:
        if isinstance(ev, Capture):
            return self._apply_capture(s, ev, b)
        if isinstance(ev, Rating):
            return self._apply_rating(s, ev, train_model, b)
        return self._apply_undo(s, ev, b)

    def _apply_in(self, s: Session, events: Sequence[Capture | Rating | Undo], train_model: str,
                  refuse: bool) -> list[Applied]:
        b = self._prefetch(s, events)
        out: list[Applied] = []
        new_rows: list[tuple[int, RatingRow]] = []
        for ev in events:
            b.fresh = None
            try:
                out.append(self._apply(s, ev, train_model, b))
            except (BadInput, NotFound) as exc:
                if refuse:
                    raise
                out.append(Applied(False, str(exc)))
            if b.fresh is not None:
                new_rows.append((len(out) - 1, b.fresh))
        s.flush()  # one INSERT per table for the whole batch; the new rows' ids are part of the answers
        for i, row in new_rows:
            out[i] = replace(out[i], rating_id=row.id)
        return out

    def apply_many(self, events: Sequence[Capture | Rating | Undo], train_model: str, *,
                   durable: bool = True) -> list[Applied]:
        """Apply events in order in one transaction; a refused event is an ``ok=False`` answer and the
        others still apply. Raises IntegrityError when another process applied one of them meanwhile
        (then nothing of the batch is written: apply them one by one). Not ``durable``: the commit
        does not wait for the disk; ``sync`` does (see shared/dbsync.py)."""
        with self.session(durable) as s:
            fast = _fast_apply(s.connection(), events, train_model)
            return fast if fast is not None else self._apply_in(s, events, train_model, refuse=False)

    def sync(self) -> None:
        """Every commit made before this call, deferred ones included, is on disk when it returns."""
        dbsync.sync(self.engine)

    def apply_one(self, ev: Capture | Rating | Undo, train_model: str = "", refuse: bool = True) -> Applied:
        """One event in its own transaction; refusals raise (or, without ``refuse``, are ``ok=False``
        answers). A concurrent worker that applied the same event first makes this a duplicate."""
        try:
            with self.session() as s:
                return self._apply_in(s, [ev], train_model, refuse=refuse)[0]
        except IntegrityError:
            return Applied(True, "already recorded", duplicate=True,
                           capture_id=ev.capture_id if isinstance(ev, Capture) else None)

    def apply_capture(self, ev: Capture) -> Applied:
        return self.apply_one(ev)

    def apply_rating(self, ev: Rating, train_model: str) -> Applied:
        return self.apply_one(ev, train_model)

    def apply_undo(self, ev: Undo) -> Applied:
        return self.apply_one(ev)

    # ---- dataset export / import (shared/ratings_io.py) ------------------------------------------

    def rated_pairs(self, model: str | None = None, all_states: bool = False) -> list[tuple[RatingRow, CaptureRow]]:
        """Ratings with their captures, oldest first: the active ones, or every one with ``all_states``."""
        q = select(RatingRow, CaptureRow).join(CaptureRow, RatingRow.capture_id == CaptureRow.id)
        if model is not None:
            q = q.where(RatingRow.train_model == model)
        if not all_states:
            q = q.where(RatingRow.state == "active")
        with self.session() as s:
            return [(r, c) for r, c in s.execute(q.order_by(RatingRow.created, RatingRow.id)).all()]

    def import_example(self, ex) -> str | None:
        """Insert one exported rating (and its capture, if new) as it was; None when imported, else why
        it was skipped.

        What is here now decides, not which event ids were ever applied: a rating purged by ``reset
        --purge-ratings`` left its event id behind, and a backup must still bring it back. An active
        rating undone here since the export is active again (unless the answer has another active
        rating); one that is here as the file has it is skipped, so a second import adds nothing."""
        p = ex.rlfleet
        try:
            with self.session() as s:
                row = s.scalars(select(RatingRow).where(RatingRow.event_id == p.rating_event_id)).first()
                if row is not None:
                    return self._restore(s, row, p)
                cap = self._import_capture(s, ex)
                if p.state == "active" and self._has_active(s, cap.id):
                    raise _Skip("that answer already has an active rating here")
                self._remember(s, p.rating_event_id, "rating")
                s.add(RatingRow(
                    event_id=p.rating_event_id, capture_id=cap.id, train_model=p.train_model, actor=p.actor,
                    source=p.source, value=p.value, comment=ex.comment, state=p.state,
                    adapter_version=p.adapter_version, created=_utc(p.rated_at), changed=_utc(p.changed_at),
                ))
        except _Skip as skip:
            return str(skip)
        except IntegrityError:  # a concurrent import of the same line
            return "already imported"
        return None

    def _restore(self, s: Session, row: RatingRow, p) -> str | None:
        """The exported rating whose row is here: bring back an active one undone or replaced since
        the export, else skip it."""
        if p.state != "active" or row.state == "active" or row.state == p.state:
            raise _Skip("already imported")
        if self._has_active(s, row.capture_id):
            raise _Skip("that answer was rated again here since the export")
        if row.retract_run_id is not None:  # its training was taken back: it trains again, as a new rating
            row.run_id = row.retract_run_id = row.advantage = None
        row.state, row.changed = "active", _utc(p.changed_at)
        return None

    def _import_capture(self, s: Session, ex) -> CaptureRow:
        p = ex.rlfleet
        cap = s.get(CaptureRow, p.capture_id)
        if cap is not None:
            if cap.response != ex.response or cap.event_id != p.capture_event_id:
                raise _Skip("capture id already used by another answer")
            return cap
        if s.scalar(select(CaptureRow.id).where(CaptureRow.event_id == p.capture_event_id)) is not None:
            raise _Skip("capture event id already used by another answer")
        self._remember(s, p.capture_event_id, "capture")
        cap = CaptureRow(
            id=p.capture_id, event_id=p.capture_event_id, source=p.capture_source,
            conversation=p.conversation, message_ref=p.message_ref, owner=p.owner,
            prompt=[m.model_dump() for m in ex.prompt], response=ex.response, model=p.model,
            adapter_version=p.adapter_version, behaviour_logprobs=p.behaviour_logprobs,
            behaviour_token_ids=p.behaviour_token_ids, created=_utc(p.captured_at),
        )
        s.add(cap)
        s.flush()
        return cap

    @staticmethod
    def _has_active(s: Session, capture_id: str) -> bool:
        return s.scalar(select(RatingRow.id).where(RatingRow.capture_id == capture_id,
                                                   RatingRow.state == "active")) is not None

    @staticmethod
    def _remember(s: Session, event_id: str, kind: str) -> None:
        """The idempotency record of an imported row: a re-delivered live event stays a no-op. It may be
        here already (the row was purged, the record kept)."""
        if s.get(ProcessedEvent, event_id) is None:
            s.add(ProcessedEvent(event_id=event_id, kind=kind))

    # ---- training data ------------------------------------------------------------------------

    @staticmethod
    def _pending_clause(model: str):
        fresh = (RatingRow.state == "active") & RatingRow.run_id.is_(None)
        # trained, then undone or replaced, and not yet retracted: the next run undoes its effect
        retract = (
            RatingRow.state.in_(("undone", "replaced"))
            & RatingRow.run_id.is_not(None)
            & RatingRow.retract_run_id.is_(None)
        )
        return (RatingRow.train_model == model) & or_(fresh, retract)

    def pending_count(self, model: str, since: datetime | None = None) -> int:
        """Active ratings not trained on yet (only those made after ``since``, when given)."""
        clause = (RatingRow.train_model == model) & (RatingRow.state == "active") & RatingRow.run_id.is_(None)
        if since is not None:
            clause &= RatingRow.created > _utc(since)
        with self.session() as s:
            return s.scalar(select(func.count()).select_from(RatingRow).where(clause)) or 0

    def pending_ratings(self, model: str, cap: int) -> list[tuple[RatingRow, CaptureRow]]:
        with self.session() as s:
            rows = s.execute(
                select(RatingRow, CaptureRow)
                .join(CaptureRow, CaptureRow.id == RatingRow.capture_id)
                .where(self._pending_clause(model))
                .order_by(RatingRow.created, RatingRow.id)
                .limit(cap)
            ).all()
            return [(r, c) for r, c in rows]

    def counts(self, model: str) -> Counts:
        with self.session() as s:
            active = (RatingRow.train_model == model) & (RatingRow.state == "active")
            good = s.scalar(select(func.count()).where(active & (RatingRow.value > 0))) or 0
            bad = s.scalar(select(func.count()).where(active & (RatingRow.value < 0))) or 0
        return Counts(total=good + bad, good=good, bad=bad, pending=self.pending_count(model))

    # ---- runs, versions, baseline --------------------------------------------------------------

    def create_run(self, model: str) -> int:
        with self.session() as s:
            lineage = self._baseline(s, model).lineage
            run = TrainRun(model=model, state="queued", lineage=lineage)
            s.add(run)
            s.flush()
            return run.id

    def get_run(self, run_id: int) -> TrainRun | None:
        with self.session() as s:
            return s.get(TrainRun, run_id)

    def latest_run(self, model: str) -> TrainRun | None:
        runs = self.recent_runs(model, 1)
        return runs[0] if runs else None

    def recent_runs(self, model: str, n: int) -> list[TrainRun]:
        """The model's last ``n`` runs, newest first."""
        with self.session() as s:
            return list(s.scalars(
                select(TrainRun).where(TrainRun.model == model).order_by(TrainRun.id.desc()).limit(n)
            ))

    def start_run(self, run_id: int, parent: str | None) -> None:
        with self.session() as s:
            run = s.get(TrainRun, run_id)
            if run is None:
                raise NotFound(f"no training run {run_id}")
            run.state, run.parent, run.started, run.error = "running", parent, datetime.now(timezone.utc), None

    def fail_run(self, run_id: int, error: str, state: str = "failed") -> None:
        with self.session() as s:
            run = s.get(TrainRun, run_id)
            if run is not None:
                run.state, run.error, run.finished = state, error[:2000], datetime.now(timezone.utc)

    def finish_run(
        self,
        run_id: int,
        *,
        model: str,
        version: str,
        parent: str | None,
        metrics: dict,
        advantages: dict[int, float],
        retracted: list[int],
        new_ema: float,
        promote: bool,
        reason: str | None = None,
    ) -> str:
        """Record a finished run atomically. Returns the version's status (active | rejected | stale)."""
        now = datetime.now(timezone.utc)
        with self.session() as s:
            run = s.get(TrainRun, run_id)
            if run is None:
                raise NotFound(f"no training run {run_id}")
            base = self._baseline(s, model)
            stale = base.lineage != run.lineage  # a reset happened while this run trained
            status = "stale" if stale else ("active" if promote else "rejected")
            if status == "active":
                s.execute(
                    update(AdapterVersion)
                    .where(AdapterVersion.model == model, AdapterVersion.status == "active")
                    .values(status="candidate")
                )
            s.add(
                AdapterVersion(
                    model=model, version=version, status=status, parent=parent, run_id=run_id,
                    lineage=run.lineage, metrics=metrics, created=now,
                )
            )
            run.version, run.metrics, run.finished = version, metrics, now
            run.state = {"active": "succeeded", "rejected": "rejected", "stale": "stale"}[status]
            run.error = reason if status != "active" else None
            if status == "active":
                # The ratings are consumed only by a promoted run; otherwise they stay pending.
                self._consume(s, base, run_id, advantages, retracted, new_ema)
            return status

    @staticmethod
    def _consume(
        s: Session, base: Baseline, run_id: int, advantages: dict[int, float], retracted: list[int],
        new_ema: float,
    ) -> None:
        for rid, adv in advantages.items():
            s.execute(update(RatingRow).where(RatingRow.id == rid).values(run_id=run_id, advantage=adv))
        if retracted:
            s.execute(update(RatingRow).where(RatingRow.id.in_(retracted)).values(retract_run_id=run_id))
        base.ema = new_ema
        base.count += len(advantages)

    def version(self, model: str, version: str) -> AdapterVersion | None:
        with self.session() as s:
            return s.scalars(
                select(AdapterVersion).where(AdapterVersion.model == model, AdapterVersion.version == version)
            ).first()

    def force_promote(
        self,
        model: str,
        version: str,
        advantages: dict[int, float],
        retracted: list[int],
        ema_after: Callable[[float | None, list[float]], float],
    ) -> int:
        """Serve a version the gate rejected, as if its run had passed: it becomes active and consumes
        those of its ratings still pending (the EMA moves over them). Returns how many it consumed."""
        with self.session() as s:
            row = s.scalars(
                select(AdapterVersion).where(AdapterVersion.model == model, AdapterVersion.version == version)
            ).first()
            if row is None:
                raise NotFound(f"no adapter version {version}")
            base = self._baseline(s, model)
            if row.lineage != base.lineage:
                raise BadInput(f"{version} is from before a reset: it belongs to an old lineage")
            still = {
                r.id: r.value
                for r in s.scalars(
                    select(RatingRow).where(
                        RatingRow.id.in_(list(advantages)), RatingRow.run_id.is_(None), RatingRow.state == "active"
                    )
                )
            }
            ema = ema_after(base.ema, [float(still[rid]) for rid in sorted(still)])
            retracted = list(
                s.scalars(
                    select(RatingRow.id).where(RatingRow.id.in_(retracted), RatingRow.retract_run_id.is_(None))
                )
            )
            s.execute(
                update(AdapterVersion)
                .where(AdapterVersion.model == model, AdapterVersion.status == "active")
                .values(status="candidate")
            )
            row.status = "active"
            keep = {rid: adv for rid, adv in advantages.items() if rid in still}
            self._consume(s, base, row.run_id, keep, retracted, ema)
            return len(keep)

    def _baseline(self, s: Session, model: str) -> Baseline:
        base = s.get(Baseline, model)
        if base is None:
            # Several processes (`up`'s status panel, the workers' recovery) may create it at once:
            # the loser of a plain INSERT raised IntegrityError and `up` exited. Insert-or-nothing, then read.
            from sqlalchemy.dialects import postgresql, sqlite

            dialect = s.get_bind().dialect.name
            insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(dialect)
            if insert is None:  # another database: the plain insert
                base = Baseline(model=model, ema=None, count=0, lineage=0)
                s.add(base)
                s.flush()
                return base
            s.execute(insert(Baseline).values(model=model, ema=None, count=0, lineage=0)
                      .on_conflict_do_nothing(index_elements=["model"]))
            base = s.get(Baseline, model)
        return base

    def baseline(self, model: str) -> tuple[float | None, int]:
        with self.session() as s:
            b = self._baseline(s, model)
            return b.ema, b.lineage

    def versions(self, model: str) -> list[AdapterVersion]:
        with self.session() as s:
            return list(
                s.scalars(select(AdapterVersion).where(AdapterVersion.model == model).order_by(AdapterVersion.id))
            )

    def set_active(self, model: str, version: str | None, demoted_status: str = "rolled_back") -> None:
        """Make ``version`` active (None: the base); the one it replaces gets ``demoted_status``."""
        with self.session() as s:
            s.execute(
                update(AdapterVersion)
                .where(AdapterVersion.model == model, AdapterVersion.status == "active")
                .values(status=demoted_status)
            )
            if version is not None:
                s.execute(
                    update(AdapterVersion)
                    .where(AdapterVersion.model == model, AdapterVersion.version == version)
                    .values(status="active")
                )

    def reset(self, model: str, purge_ratings: bool) -> int:
        """Start a fresh lineage: versions become stale, the EMA restarts. Returns purged rating count."""
        with self.session() as s:
            base = self._baseline(s, model)
            base.lineage += 1
            base.ema, base.count = None, 0
            s.execute(update(AdapterVersion).where(AdapterVersion.model == model).values(status="stale"))
            purged = 0
            if purge_ratings:
                ids = list(s.scalars(select(RatingRow.id).where(RatingRow.train_model == model)))
                purged = len(ids)
                if ids:
                    s.execute(RatingRow.__table__.delete().where(RatingRow.id.in_(ids)))
            else:
                # Trained ratings belong to the old lineage: nothing to retract from a fresh base.
                s.execute(
                    update(RatingRow)
                    .where(RatingRow.train_model == model, RatingRow.run_id.is_not(None),
                           RatingRow.retract_run_id.is_(None), RatingRow.state != "active")
                    .values(retract_run_id=RatingRow.run_id)
                )
            return purged


@dataclass
class _Active:
    """A capture's active rating as the fast path sees it: a row already stored (``id`` set) or one
    this batch inserts (``new``: its column values; ``waiting``: the answers its id goes into)."""

    id: int | None
    value: int
    comment: str | None
    new: dict | None = None
    waiting: list[int] | None = None


_RATINGS, _EVENTS, _CAPTURES = RatingRow.__table__, ProcessedEvent.__table__, CaptureRow.__table__
# built once: composing a statement costs more Python than running it on SQLite
_DONE = select(_EVENTS.c.event_id).where(_EVENTS.c.event_id.in_(bindparam("ids", expanding=True)))
_TARGETS = (
    select(_CAPTURES.c.id, _CAPTURES.c.owner, _CAPTURES.c.adapter_version, _CAPTURES.c.response,
           _RATINGS.c.id, _RATINGS.c.value, _RATINGS.c.comment)
    .outerjoin(_RATINGS, (_RATINGS.c.capture_id == _CAPTURES.c.id) & (_RATINGS.c.state == "active"))
    .where(_CAPTURES.c.id.in_(bindparam("ids", expanding=True)))
)
_CLAIM, _ADD_CAPTURES = insert(_EVENTS), insert(_CAPTURES)
_ADD_RATINGS = insert(_RATINGS).returning(_RATINGS.c.id, sort_by_parameter_order=True)
_REPLACE = update(_RATINGS).where(_RATINGS.c.id == bindparam("rid")).values(state="replaced")


def _fast_apply(conn: Connection, events: Sequence[Capture | Rating | Undo], train_model: str
                ) -> list[Applied] | None:
    """The common batch (captures, and ratings addressing stored captures by id) in SQLAlchemy Core:
    the answers ``Store._apply_in`` gives, at a fraction of the ORM's cost per batch. None (and
    nothing written) when the batch holds anything else: an undo, a ``last`` or message-ref target, a
    capture rated or its id reused in the same batch; the ORM path applies those."""
    if any(isinstance(ev, Undo) for ev in events):
        return None
    ids = [ev.event_id for ev in events]
    done = {r[0] for r in conn.execute(_DONE, {"ids": ids})}
    wanted = {ev.target if isinstance(ev, Rating) else ev.capture_id for ev in events}
    caps: dict[str, tuple] = {}
    active: dict[str, _Active | None] = {}
    for cid, owner, version, response, rid, value, comment in conn.execute(_TARGETS, {"ids": list(wanted)}):
        caps[cid] = (owner, version, response)
        if rid is not None or cid not in active:
            active[cid] = _Active(rid, value, comment) if rid is not None else None
    out: list[Applied] = []
    claims: list[dict] = []
    new_caps: list[dict] = []
    new_ratings: list[_Active] = []
    replaced: list[tuple[int, datetime]] = []
    taken: set[str] = set()
    for ev in events:
        if ev.event_id in done:  # applied before: the repeat is ignored
            out.append(Applied(True, "already recorded", duplicate=True,
                               capture_id=ev.capture_id if isinstance(ev, Capture) else None))
            continue
        if isinstance(ev, Capture):
            if ev.capture_id in taken:
                return None
            if ev.capture_id in caps:
                out.append(Applied(False, f"capture id {ev.capture_id} is already taken"))
                continue
            taken.add(ev.capture_id)
            done.add(ev.event_id)
            claims.append({"event_id": ev.event_id, "kind": "capture"})
            new_caps.append(_capture_values(ev))
            out.append(Applied(True, f"captured {ev.capture_id}", capture_id=ev.capture_id))
            continue
        if ev.target == "last" or ev.target not in caps:  # a ref, or a capture of this batch: the ORM resolves it
            return None
        owner, version, response = caps[ev.target]
        if ev.scope != "any" and owner != ev.actor:  # what the ingress's permission decision granted
            out.append(Applied(False, "nothing of yours to rate here"))
            continue
        done.add(ev.event_id)
        claims.append({"event_id": ev.event_id, "kind": "rating"})
        now = datetime.now(timezone.utc)
        current = active.get(ev.target)
        if current is not None and current.value == ev.value and current.comment == ev.comment:
            if current.new is not None:  # inserted by this batch: its id comes with the INSERT
                current.waiting = (current.waiting or []) + [len(out)]
            out.append(Applied(True, "already rated that way", capture_id=ev.target, rating_id=current.id,
                               value=ev.value))
            continue
        if current is not None:
            if current.new is not None:
                current.new.update(state="replaced", changed=now)
            else:
                replaced.append((current.id, now))
        row = _Active(None, ev.value, ev.comment, new={
            "event_id": ev.event_id, "capture_id": ev.target, "train_model": train_model, "actor": ev.actor,
            "source": ev.source, "value": ev.value, "comment": ev.comment, "state": "active",
            "adapter_version": version, "created": now, "changed": now,
        }, waiting=[len(out)])
        active[ev.target] = row
        new_ratings.append(row)
        out.append(Applied(True, _rated(ev.value, current is not None, response), capture_id=ev.target,
                           value=ev.value))
    if claims:
        conn.execute(_CLAIM, claims)
    if new_caps:
        conn.execute(_ADD_CAPTURES, new_caps)
    if replaced:
        conn.execute(_REPLACE, [{"rid": rid, "changed": at} for rid, at in replaced])
    if new_ratings:
        got = conn.execute(_ADD_RATINGS, [r.new for r in new_ratings])
        for row, (rid,) in zip(new_ratings, got, strict=True):
            for i in row.waiting or []:
                out[i] = replace(out[i], rating_id=rid)
    return out


def _capture_values(ev: Capture) -> dict:
    return {
        "id": ev.capture_id, "event_id": ev.event_id, "source": ev.source, "conversation": ev.conversation,
        "message_ref": ev.message_ref, "owner": ev.owner, "prompt": [m.model_dump() for m in ev.prompt],
        "response": ev.response, "model": ev.model, "adapter_version": ev.adapter_version,
        "behaviour_logprobs": ev.behaviour_logprobs, "behaviour_token_ids": ev.behaviour_token_ids,
        "created": _utc(ev.ts),
    }


class _Skip(Exception):
    """Roll back one import line and say why."""


def _rated(value: int, again: bool, response: str) -> str:
    """The answer to a rating that was stored: both apply paths say it alike."""
    return f"{'re-rated' if again else 'rated'} {'good' if value > 0 else 'bad'}: {_preview(response)}"


def _preview(text: str, n: int = 60) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

