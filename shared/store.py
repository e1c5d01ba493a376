"""The store: every state change a worker makes, each in one transaction with its idempotency record.

SQLite (WAL) by default, PostgreSQL by ``DATABASE_URL``. The schema is migrated with Alembic on open.
Functions here take typed events and return small result dataclasses; nothing here knows about Redis.
Beside it: the engines and migrations (shared/engines.py), the hot path of a batch (shared/fast_apply.py),
runs, versions and the baseline (shared/ledger.py), and what an apply answers (shared/applied.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer, sessionmaker

from . import dbsync
from .applied import Applied, TrainModel, as_utc, capture_values, kept_words, lineage_of, rated, reasoned
from .config import redact_url
from .engines import _MIGRATED, engine_for, migrate
from .engines import forget as forget  # a dropped database's engines: tests and benchmarks close them
from .errors import BadInput, ConfigError, NotFound
from .events import PLATFORMS, Capture, Rating, Undo
from .fast_apply import fast_apply
from .ledger import RunLedger
from .registry import version_name
from .schema import Baseline, CaptureRow, ProcessedEvent, RatingRow, TrainRun


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


class Store(RunLedger):
    def __init__(self, url: str, *, migrate_schema: bool = True) -> None:
        self.url = url
        self.engine = engine_for(url)
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

    def close(self) -> None:
        """Close the pooled connections (their files, for SQLite); the store still works, opening new
        ones on its next use. For an owner done with the database whose process goes on (an agent)."""
        self.engine.dispose()
        if self._deferred is not None:
            engine_for(self.url, deferred=True).dispose()

    @contextmanager
    def session(self, durable: bool = True) -> Iterator[Session]:
        """One transaction; not ``durable``: its commit does not wait for the disk (``sync`` does)."""
        if durable:
            maker = self._sessions
        else:
            if self._deferred is None:
                self._deferred = sessionmaker(engine_for(self.url, deferred=True), expire_on_commit=False)
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
        s.add(CaptureRow(**capture_values(ev)))
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

    def _apply_rating(self, s: Session, ev: Rating, train_model: TrainModel, b: _Batch) -> Applied:
        if ev.event_id in b.done:  # applied before: the repeat is ignored
            return Applied(True, "already recorded", duplicate=True)
        anyones = ev.scope == "any"  # what the ingress's permission decision granted
        if ev.value is None and ev.target == "last":  # a reason for the actor's latest rating
            cap = self._last_rated(s, ev.actor, ev.conversation)
        else:
            cap = self._resolve_target(s, ev.target, ev.actor, ev.conversation, ev.source, anyones)
        if not anyones and cap.owner != ev.actor:
            raise NotFound("nothing of yours to rate here")
        current = self._active(s, cap.id, b)
        value: int = ev.value if ev.value is not None else self._own_value(current, ev.actor)
        # A reason said afterwards keeps the rating's stars, as it keeps its thumb.
        stars = ev.stars if ev.value is not None else (current.stars if current is not None else None)
        reward = ev.reward if ev.value is not None else (current.reward if current is not None else None)
        comment, stars = kept_words(current, value, ev.comment, stars)
        self._claim(s, ev.event_id, "rating", b)
        now = datetime.now(timezone.utc)
        if (current is not None and current.value == value and current.comment == comment
                and current.stars == stars and current.reward == reward):
            if current.id is None:  # added earlier in this batch: its id comes with the flush
                b.fresh = current
            return Applied(True, "already rated that way", capture_id=cap.id, rating_id=current.id, value=value,
                           train_model=current.train_model)
        if current is not None:  # a new reason replaces the rating too: a run trains on what it says
            current.state = "replaced"
            current.changed = now
        row = RatingRow(
            event_id=ev.event_id,
            capture_id=cap.id,
            train_model=lineage_of(train_model, ev, cap.conversation),
            actor=ev.actor,
            source=ev.source,
            value=value,
            comment=comment,
            stars=stars,
            reward=reward,
            state="active",
            adapter_version=cap.adapter_version,
            created=now,
            changed=now,
        )
        s.add(row)
        b.active[cap.id] = row
        b.fresh = row
        said = (reasoned(value, ev.comment) if ev.value is None
                else rated(value, current is not None, cap.response, stars))
        return Applied(True, said, capture_id=cap.id, value=value, train_model=row.train_model)

    @staticmethod
    def _last_rated(s: Session, actor: str, conversation: str | None) -> CaptureRow:
        """The answer of ``actor``'s latest active rating (in ``conversation``, when given)."""
        q = (select(CaptureRow).join(RatingRow, RatingRow.capture_id == CaptureRow.id)
             .where(RatingRow.actor == actor, RatingRow.state == "active"))
        if conversation:
            q = q.where(CaptureRow.conversation == conversation)
        row = s.scalars(q.order_by(RatingRow.created.desc(), RatingRow.id.desc()).limit(1)).first()
        if row is None:
            raise NotFound("nothing you rated here yet: /rl bad <why> rates an answer and says why at once")
        return row

    @staticmethod
    def _own_value(current: RatingRow | None, actor: str) -> int:
        """The value a reason said afterwards keeps: ``actor``'s own active rating of the answer."""
        if current is None or current.actor != actor:
            raise NotFound("you have not rated that answer: rate it with its reason, /rl bad <why>")
        return current.value

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

    def _apply(self, s: Session, ev: Capture | Rating | Undo, train_model: TrainModel, b: _Batch) -> Applied:
        if isinstance(ev, Capture):
            return self._apply_capture(s, ev, b)
        if isinstance(ev, Rating):
            return self._apply_rating(s, ev, train_model, b)
        return self._apply_undo(s, ev, b)

    def _apply_in(self, s: Session, events: Sequence[Capture | Rating | Undo], train_model: TrainModel,
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

    def apply_many(self, events: Sequence[Capture | Rating | Undo], train_model: TrainModel, *,
                   durable: bool = True) -> list[Applied]:
        """Apply events in order in one transaction; a refused event is an ``ok=False`` answer and the
        others still apply. Raises IntegrityError when another process applied one of them meanwhile
        (then nothing of the batch is written: apply them one by one). Not ``durable``: the commit
        does not wait for the disk; ``sync`` does (see shared/dbsync.py)."""
        with self.session(durable) as s:
            fast = fast_apply(s.connection(), events, train_model)
            return fast if fast is not None else self._apply_in(s, events, train_model, refuse=False)

    def sync(self) -> None:
        """Every commit made before this call, deferred ones included, is on disk when it returns."""
        dbsync.sync(self.engine)

    def apply_one(self, ev: Capture | Rating | Undo, train_model: TrainModel = "", refuse: bool = True) -> Applied:
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

    def apply_rating(self, ev: Rating, train_model: TrainModel) -> Applied:
        return self.apply_one(ev, train_model)

    def apply_undo(self, ev: Undo) -> Applied:
        return self.apply_one(ev)

    # ---- dataset export / import (shared/ratings_io.py) ------------------------------------------

    def rated_pairs(self, model: str | None = None, all_states: bool = False,
                    with_scopes: bool = False) -> list[tuple[RatingRow, CaptureRow]]:
        """Ratings with their captures, oldest first: the active ones, or every one with ``all_states``;
        of lineage ``model`` (and, ``with_scopes``, of its scopes' lineages too: shared/scopes.py)."""
        q = select(RatingRow, CaptureRow).join(CaptureRow, RatingRow.capture_id == CaptureRow.id)
        if model is not None:
            q = q.where((RatingRow.train_model == model) | (RatingRow.train_model.like(_scopes_of(model), escape="\\"))
                        if with_scopes else RatingRow.train_model == model)
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
                    source=p.source, value=p.value, comment=ex.comment, stars=ex.stars, reward=ex.reward,
                    state=p.state,
                    adapter_version=p.adapter_version, created=as_utc(p.rated_at), changed=as_utc(p.changed_at),
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
        row.state, row.changed = "active", as_utc(p.changed_at)
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
            behaviour_token_ids=p.behaviour_token_ids, finish_reason=p.finish_reason, created=as_utc(p.captured_at),
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

    # An agent's rated steps (rlfleet.gym) train in the agent's own runs, with their episode's returns
    # and baselines, never as a chat rating of a worker's run.
    _RATED_BY_PEOPLE = RatingRow.reward.is_(None)

    @classmethod
    def _pending_clause(cls, model: str):
        fresh = (RatingRow.state == "active") & RatingRow.run_id.is_(None) & cls._RATED_BY_PEOPLE
        # trained, then undone or replaced, and not yet retracted: the next run undoes its effect
        retract = (
            RatingRow.state.in_(("undone", "replaced"))
            & RatingRow.run_id.is_not(None)
            & RatingRow.retract_run_id.is_(None)
        )
        return (RatingRow.train_model == model) & or_(fresh, retract)

    def pending_count(self, model: str, since: datetime | None = None) -> int:
        """Active ratings not trained on yet (only those made after ``since``, when given); an agent's
        steps are its own runs' (:meth:`untrained_steps`)."""
        clause = ((RatingRow.train_model == model) & (RatingRow.state == "active") & RatingRow.run_id.is_(None)
                  & self._RATED_BY_PEOPLE)
        if since is not None:
            clause &= RatingRow.created > as_utc(since)
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

    def scope_lineages(self, model: str) -> list[str]:
        """The lineages of ``model``'s scopes other than the shared one that hold ratings or runs
        (shared/scopes.py), by name."""
        like = _scopes_of(model)
        with self.session() as s:
            rated = s.scalars(select(RatingRow.train_model).where(RatingRow.train_model.like(like, escape="\\"))
                              .distinct()).all()
            ran = s.scalars(select(TrainRun.model).where(TrainRun.model.like(like, escape="\\")).distinct()).all()
        return sorted(set(rated) | set(ran))

    def untrained_steps(self, model: str, actor: str) -> list[tuple[RatingRow, CaptureRow]]:
        """The rated steps of the environment agent ``actor`` that no run trained on (episodes stored
        before the agent stopped with a batch unfilled), oldest first."""
        with self.session() as s:
            rows = s.execute(
                select(RatingRow, CaptureRow)
                .join(CaptureRow, CaptureRow.id == RatingRow.capture_id)
                .where(RatingRow.train_model == model, RatingRow.actor == actor, RatingRow.state == "active",
                       RatingRow.run_id.is_(None), RatingRow.reward.is_not(None))
                .order_by(RatingRow.created, RatingRow.id)
            ).all()
            return [(r, c) for r, c in rows]

    def replay_pool(self, model: str) -> list[tuple[int, int]]:
        """``(rating id, value)`` of every rating a run may replay: active, trained on by a promoted
        run of the current lineage (a reset forgets what came before). Pending ratings, the gate's
        held-out ones among them, and retractions are never in it (worker/replay.py)."""
        lineage = select(Baseline.lineage).where(Baseline.model == model).scalar_subquery()
        with self.session() as s:
            rows = s.execute(
                select(RatingRow.id, RatingRow.value)
                .join(TrainRun, TrainRun.id == RatingRow.run_id)
                .where(RatingRow.train_model == model, RatingRow.state == "active", self._RATED_BY_PEOPLE,
                       TrainRun.model == model, TrainRun.lineage == lineage)
                .order_by(RatingRow.id)
            ).all()
            return [(rid, value) for rid, value in rows]

    def unrated_prompts(self, n: int) -> list[list[dict]]:
        """The prompts of the ``n`` newest answers nobody rates (no active rating), newest first: what
        a run's exploration samples beside its rated prompts (worker/training/exploration.py)."""
        if n <= 0:
            return []
        rated = select(RatingRow.id).where(RatingRow.capture_id == CaptureRow.id, RatingRow.state == "active")
        with self.session() as s:
            rows = s.execute(
                select(CaptureRow.prompt).where(~rated.exists())
                .order_by(CaptureRow.created.desc(), CaptureRow.id.desc()).limit(n)
            ).scalars().all()
            return [list(p) for p in rows]

    def stars_given(self, model: str) -> dict[str, list[int]]:
        """Each person's stars on their active star ratings for ``model`` (a rating's reward weighs its
        stars against the person's usual ones: worker/training/rewards.py)."""
        with self.session() as s:
            rows = s.execute(select(RatingRow.actor, RatingRow.stars).where(
                RatingRow.train_model == model, RatingRow.state == "active", RatingRow.stars.is_not(None)))
            out: dict[str, list[int]] = {}
            for actor, stars in rows:
                if stars is not None:  # the query's filter; the row type cannot say so
                    out.setdefault(actor, []).append(int(stars))
            return out

    def ratings_with_captures(self, ids: Sequence[int]) -> list[tuple[RatingRow, CaptureRow]]:
        """The ratings ``ids`` with their captures, in id order."""
        if not ids:
            return []
        with self.session() as s:
            rows = s.execute(
                select(RatingRow, CaptureRow)
                .join(CaptureRow, CaptureRow.id == RatingRow.capture_id)
                .where(RatingRow.id.in_(list(ids)))
                .order_by(RatingRow.id)
            ).all()
            return [(r, c) for r, c in rows]

    def rating_marks(self, model: str, since: datetime) -> list[RatingMark]:
        """The active ratings of ``model`` made since ``since``, oldest first, as the dashboard plots
        them: when, which way, from where."""
        with self.session() as s:
            rows = s.execute(select(RatingRow.created, RatingRow.value, RatingRow.source).where(
                RatingRow.train_model == model, RatingRow.state == "active", RatingRow.created >= since,
            ).order_by(RatingRow.id))
            return [RatingMark(as_utc(created), int(value), source) for created, value, source in rows]

    def counts_by_source(self, model: str) -> list[tuple[str, int, bool, int]]:
        """(source, value, pending, how many) over the active ratings of ``model``."""
        with self.session() as s:
            pending = RatingRow.run_id.is_(None)
            rows = s.execute(select(RatingRow.source, RatingRow.value, pending, func.count()).where(
                RatingRow.train_model == model, RatingRow.state == "active",
            ).group_by(RatingRow.source, RatingRow.value, pending))
            return [(source, int(value), bool(p), int(n)) for source, value, p, n in rows]

    def browse_ratings(self, model: str, f: RatingFilter) -> tuple[int, list[BrowsedRating]]:
        """The ratings of ``model`` that ``f`` selects, newest first, one page of them, and how many match
        in all (the web app's ratings browser)."""
        where = [RatingRow.train_model == model]
        if f.state != "all":
            where.append(RatingRow.state == f.state)
        if f.source:  # as people type them: `Slack`, `v3`, ` 3 `
            where.append(func.lower(RatingRow.source) == f.source.strip().lower())
        if f.actor:
            where.append(RatingRow.actor == f.actor.strip())
        if f.value:
            where.append(RatingRow.value == f.value)
        if f.version.strip().lower() == "pending":
            where.append(RatingRow.run_id.is_(None))
        elif f.version.strip():
            where.append(TrainRun.version == version_name(f.version))
        if f.text:  # the words of the rating or of the answer it rates (LIKE's wildcards taken literally)
            like = "%" + f.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where.append(or_(RatingRow.comment.ilike(like, escape="\\"),
                             CaptureRow.response.ilike(like, escape="\\")))
        joined = (select(RatingRow, CaptureRow, TrainRun.version)
                  .join(CaptureRow, CaptureRow.id == RatingRow.capture_id)
                  .outerjoin(TrainRun, TrainRun.id == RatingRow.run_id).where(*where))
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(joined.subquery())) or 0
            rows = s.execute(joined.order_by(RatingRow.id.desc()).limit(f.limit).offset(f.offset)).all()
            return total, [BrowsedRating.of(r, c, v) for r, c, v in rows]

    def rating_ref(self, rating_id: int) -> tuple[str, str, str, str] | None:
        """``(source, actor, capture_id, state)`` of the stored rating ``rating_id``, or None."""
        with self.session() as s:
            row = s.get(RatingRow, rating_id)
            return None if row is None else (row.source, row.actor, row.capture_id, row.state)

    def applied_events(self) -> dict[str, int]:
        """How many events of each kind have been applied, ever (the idempotency records)."""
        with self.session() as s:
            rows = s.execute(select(ProcessedEvent.kind, func.count()).group_by(ProcessedEvent.kind))
            return {kind: int(n) for kind, n in rows}

    def counts(self, model: str) -> Counts:
        with self.session() as s:
            active = (RatingRow.train_model == model) & (RatingRow.state == "active")
            good = s.scalar(select(func.count()).where(active & (RatingRow.value > 0))) or 0
            bad = s.scalar(select(func.count()).where(active & (RatingRow.value < 0))) or 0
        return Counts(total=good + bad, good=good, bad=bad, pending=self.pending_count(model))

@dataclass(frozen=True)
class RatingMark:
    created: datetime
    value: int  # 1 or -1
    source: str


@dataclass(frozen=True)
class RatingFilter:
    """What the ratings browser asks for; empty fields select everything."""

    text: str = ""  # in the comment or the rated answer
    source: str = ""
    actor: str = ""
    value: int = 0  # 1, -1, or 0 for both
    version: str = ""  # the version whose run trained on it, or "pending"
    state: str = "active"  # active | replaced | undone | all
    limit: int = 50
    offset: int = 0


@dataclass(frozen=True)
class BrowsedRating:
    id: int
    capture_id: str
    conversation: str
    created: datetime
    source: str
    actor: str
    value: int
    stars: int | None
    reward: float | None  # an environment's, on an agent's step
    comment: str | None
    state: str
    trained_by: str | None  # the version whose run trained on it; None while pending
    prompt: str  # the last user message the answer replied to
    answer: str

    @classmethod
    def of(cls, r: RatingRow, c: CaptureRow, version: str | None) -> BrowsedRating:
        asked = next((m.get("content", "") for m in reversed(c.prompt or []) if m.get("role") == "user"), "")
        return cls(r.id, c.id, c.conversation, as_utc(r.created), r.source, r.actor, r.value, r.stars, r.reward,
                   r.comment, r.state, version, str(asked), c.response)


def _scopes_of(model: str) -> str:
    """A LIKE pattern (escape ``\\``) for the lineages of ``model``'s scopes (shared/scopes.py)."""
    return model.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "@%"


class _Skip(Exception):
    """Roll back one import line and say why."""


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

