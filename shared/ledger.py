"""Training runs, adapter versions and the reward baseline, as the store keeps them: the part of
:class:`rlfleet.shared.store.Store` a training job and the version commands use."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timezone

from sqlalchemy import Insert, select, update
from sqlalchemy.orm import Session

from .errors import BadInput, NotFound
from .schema import AdapterVersion, Baseline, RatingRow, TrainRun, table_of


class RunLedger:
    """Mixed into ``Store``: needs only its ``session()``."""

    def session(self, durable: bool = True) -> AbstractContextManager[Session]:
        raise NotImplementedError


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
        s: Session, base: Baseline, run_id: int | None, advantages: dict[int, float], retracted: list[int],
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
            claim: Insert
            if dialect == "sqlite":
                claim = sqlite.insert(Baseline).on_conflict_do_nothing(index_elements=["model"])
            elif dialect == "postgresql":
                claim = postgresql.insert(Baseline).on_conflict_do_nothing(index_elements=["model"])
            else:  # another database: the plain insert
                base = Baseline(model=model, ema=None, count=0, lineage=0)
                s.add(base)
                s.flush()
                return base
            s.execute(claim.values(model=model, ema=None, count=0, lineage=0))
            base = s.get(Baseline, model)
            assert base is not None  # inserted just now, by this session or the one that won
        return base

    def baseline(self, model: str) -> tuple[float | None, int]:
        with self.session() as s:
            b = self._baseline(s, model)
            return b.ema, b.lineage

    def training_paused(self, model: str) -> bool:
        """Whether an admin paused automatic training of ``model`` (explicit runs still start)."""
        with self.session() as s:
            return bool(s.scalar(select(Baseline.paused).where(Baseline.model == model)))

    def pause_training(self, model: str, paused: bool) -> bool:
        """Pause (``paused``) or resume automatic training of ``model``; whether that changed anything.
        Kept in the database, so a pause outlives the worker and an embedded Redis that starts empty."""
        with self.session() as s:
            base = self._baseline(s, model)
            changed = base.paused != paused
            base.paused = paused
            return changed

    def add_copied_version(self, model: str, version: str, metrics: dict) -> None:
        """Record ``version`` of lineage ``model`` as served without a run of its own (a scope's copy of
        the shared adapter it starts from: shared/scopes.py)."""
        with self.session() as s:
            base = self._baseline(s, model)
            s.execute(update(AdapterVersion).where(AdapterVersion.model == model, AdapterVersion.status == "active")
                      .values(status="candidate"))
            s.add(AdapterVersion(model=model, version=version, status="active", parent=None, run_id=None,
                                 lineage=base.lineage, metrics=metrics, created=datetime.now(timezone.utc)))

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
                    s.execute(table_of(RatingRow).delete().where(RatingRow.id.in_(ids)))
            else:
                # Trained ratings belong to the old lineage: nothing to retract from a fresh base.
                s.execute(
                    update(RatingRow)
                    .where(RatingRow.train_model == model, RatingRow.run_id.is_not(None),
                           RatingRow.retract_run_id.is_(None), RatingRow.state != "active")
                    .values(retract_run_id=RatingRow.run_id)
                )
            return purged
