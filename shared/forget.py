"""`rlfleet forget PERSON`: delete what a data dir holds of one person, and say what was deleted.

A person is a platform's user id on that platform (``slack:U024BE7LH``, ``cli:local``). Deleted: every
rating they gave; every answer given to them (their captures: prompts and answers), with any rating
of those answers; and their own adapter (a ``person`` scope's lineage, shared/scopes.py): its
versions, runs, baseline and files. What cannot be deleted is said: other adapters (the shared one, a
channel's) that already trained on their ratings keep what they learned until those are reset.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, func, select

from . import scopes
from .registry import AdapterRegistry
from .schema import AdapterVersion, Baseline, CaptureRow, RatingRow, TrainRun
from .store import Store


@dataclass
class Forgotten:
    person: str
    ratings: int = 0  # ratings deleted: theirs, and others' of answers given to them
    captures: int = 0
    versions: list[str] = field(default_factory=list)  # their own adapter's versions, deleted
    trained_elsewhere: dict[str, int] = field(default_factory=dict)  # lineage -> their ratings it trained on

    def as_dict(self) -> dict:
        return {"person": self.person, "ratings": self.ratings, "captures": self.captures,
                "adapter_versions": self.versions, "trained_elsewhere": self.trained_elsewhere}

    def message(self) -> str:
        said = (f"forgot {self.person}: {self.ratings} ratings, {self.captures} answers given to them, "
                + (f"their adapter ({', '.join(self.versions)})" if self.versions else "no adapter of their own"))
        if self.trained_elsewhere:
            where = ", ".join(f"{scopes.split(k)[1]} ({n})" for k, n in sorted(self.trained_elsewhere.items()))
            said += (f". Adapters that had already trained on their ratings keep what they learned: {where}; "
                     "`rlfleet reset` (the shared one) or `/rl reset` in a channel starts one over")
        return said


class Busy(Exception):
    """Their adapter is training: forgetting now would pull its files from under the run."""


def forget(store: Store, adapters_root: Path, slug: str, source: str, actor: str) -> Forgotten:
    """Delete ``actor`` of ``source`` from the store and their adapter from ``adapters_root``."""
    person = f"{source}:{actor}"
    lineage = scopes.lineage(slug, scopes.scope_key("person", source, actor, None))
    out = Forgotten(person)
    with store.session() as s:
        if s.scalar(select(TrainRun.id).where(TrainRun.model == lineage, TrainRun.state.in_(("queued", "running")))):
            raise Busy(f"{person}'s adapter is training now: stop the workers or wait for the run, then forget")
        theirs = select(CaptureRow.id).where(CaptureRow.source == source, CaptureRow.owner == actor)
        doomed = (RatingRow.source == source) & (RatingRow.actor == actor) | RatingRow.capture_id.in_(theirs)
        trained = Counter(s.scalars(select(RatingRow.train_model).where(
            doomed, RatingRow.run_id.is_not(None), RatingRow.train_model != lineage)))
        out.trained_elsewhere = dict(trained)
        captured = (CaptureRow.source == source) & (CaptureRow.owner == actor)
        out.ratings = s.scalar(select(func.count()).select_from(RatingRow).where(doomed)) or 0
        out.captures = s.scalar(select(func.count()).select_from(CaptureRow).where(captured)) or 0
        s.execute(delete(RatingRow).where(doomed))
        s.execute(delete(CaptureRow).where(captured))
        out.versions = sorted(s.scalars(select(AdapterVersion.version).where(AdapterVersion.model == lineage)))
        s.execute(delete(AdapterVersion).where(AdapterVersion.model == lineage))
        s.execute(delete(TrainRun).where(TrainRun.model == lineage))
        s.execute(delete(Baseline).where(Baseline.model == lineage))
    shutil.rmtree(AdapterRegistry(adapters_root, lineage).dir, ignore_errors=True)
    return out
