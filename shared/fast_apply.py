"""The store's hot path: a batch of captures, and of ratings that address stored answers by id (what
the events drain applies almost always), in SQLAlchemy Core with statements built once. It gives
the answers the ORM path (``Store._apply_in``) gives, for a fraction of its Python per batch; a batch
holding anything else is left to the ORM path, with nothing written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from sqlalchemy import Connection, bindparam, insert, select, update

from .applied import Applied, TrainModel, capture_values, kept_words, lineage_of, rated
from .events import Capture, Rating, Undo
from .schema import CaptureRow, ProcessedEvent, RatingRow, table_of

_RATINGS, _EVENTS, _CAPTURES = table_of(RatingRow), table_of(ProcessedEvent), table_of(CaptureRow)
# built once: composing a statement costs more Python than running it on SQLite
_DONE = select(_EVENTS.c.event_id).where(_EVENTS.c.event_id.in_(bindparam("ids", expanding=True)))
_TARGETS = (
    select(_CAPTURES.c.id, _CAPTURES.c.owner, _CAPTURES.c.adapter_version, _CAPTURES.c.response,
           _CAPTURES.c.conversation, _RATINGS.c.id, _RATINGS.c.value, _RATINGS.c.comment, _RATINGS.c.stars,
           _RATINGS.c.train_model)
    .outerjoin(_RATINGS, (_RATINGS.c.capture_id == _CAPTURES.c.id) & (_RATINGS.c.state == "active"))
    .where(_CAPTURES.c.id.in_(bindparam("ids", expanding=True)))
)
_CLAIM, _ADD_CAPTURES = insert(_EVENTS), insert(_CAPTURES)
_ADD_RATINGS = insert(_RATINGS).returning(_RATINGS.c.id, sort_by_parameter_order=True)
_REPLACE = update(_RATINGS).where(_RATINGS.c.id == bindparam("rid")).values(state="replaced")


class _NotHere(Exception):
    """The batch needs the ORM path."""


@dataclass
class _Active:
    """A capture's active rating as the fast path sees it: a row already stored (``id`` set) or one
    this batch inserts (``new``: its column values; ``waiting``: the answers its id goes into)."""

    id: int | None
    value: int
    comment: str | None
    stars: int | None = None
    train_model: str | None = None
    new: dict | None = None
    waiting: list[int] | None = None


@dataclass
class _Batch:
    """What the batch found stored, and what it will write."""

    done: set[str]
    caps: dict[str, tuple]  # capture id -> (owner, adapter version, response, conversation)
    active: dict[str, _Active | None]
    out: list[Applied] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)
    new_caps: list[dict] = field(default_factory=list)
    new_ratings: list[_Active] = field(default_factory=list)
    replaced: list[tuple[int, datetime]] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)


def fast_apply(conn: Connection, events: Sequence[Capture | Rating | Undo], train_model: TrainModel
               ) -> list[Applied] | None:
    """Each event's answer, written on ``conn``; None (and nothing written) when the batch holds
    anything but captures and ratings of stored answers by id: an undo, a ``last`` or message-ref
    target, a capture rated or its id reused in the same batch."""
    kept = [ev for ev in events if not isinstance(ev, Undo)]
    if len(kept) < len(events):
        return None
    b = _look_up(conn, kept)
    try:
        for ev in kept:
            if ev.event_id in b.done:  # applied before: the repeat is ignored
                b.out.append(Applied(True, "already recorded", duplicate=True,
                                     capture_id=ev.capture_id if isinstance(ev, Capture) else None))
            elif isinstance(ev, Capture):
                _capture(b, ev)
            else:
                _rate(b, ev, train_model)
    except _NotHere:
        return None
    _write(conn, b)
    return b.out


def _look_up(conn: Connection, events: Sequence[Capture | Rating]) -> _Batch:
    done = {r[0] for r in conn.execute(_DONE, {"ids": [ev.event_id for ev in events]})}
    wanted = {ev.target if isinstance(ev, Rating) else ev.capture_id for ev in events}
    b = _Batch(done, {}, {})
    rows = conn.execute(_TARGETS, {"ids": list(wanted)})
    for cid, owner, version, response, conversation, rid, value, comment, stars, lineage in rows:
        b.caps[cid] = (owner, version, response, conversation)
        if rid is not None or cid not in b.active:
            b.active[cid] = _Active(rid, value, comment, stars, lineage) if rid is not None else None
    return b


def _capture(b: _Batch, ev: Capture) -> None:
    if ev.capture_id in b.taken:
        raise _NotHere
    if ev.capture_id in b.caps:
        b.out.append(Applied(False, f"capture id {ev.capture_id} is already taken"))
        return
    b.taken.add(ev.capture_id)
    b.done.add(ev.event_id)
    b.claims.append({"event_id": ev.event_id, "kind": "capture"})
    b.new_caps.append(capture_values(ev))
    b.out.append(Applied(True, f"captured {ev.capture_id}", capture_id=ev.capture_id))


def _rate(b: _Batch, ev: Rating, train_model: TrainModel) -> None:
    if ev.target == "last" or ev.target not in b.caps:  # a ref, or a capture of this batch: the ORM resolves it
        raise _NotHere
    if ev.value is None or ev.reward is not None:  # a reason said afterwards, an agent's step: rare, the ORM's
        raise _NotHere
    owner, version, response, conversation = b.caps[ev.target]
    if ev.scope != "any" and owner != ev.actor:  # what the ingress's permission decision granted
        b.out.append(Applied(False, "nothing of yours to rate here"))
        return
    b.done.add(ev.event_id)
    b.claims.append({"event_id": ev.event_id, "kind": "rating"})
    now = datetime.now(timezone.utc)
    current = b.active.get(ev.target)
    comment, stars = kept_words(current, ev.value, ev.comment, ev.stars)
    if (current is not None and current.value == ev.value and current.comment == comment
            and current.stars == stars):
        if current.new is not None:  # inserted by this batch: its id comes with the INSERT
            current.waiting = (current.waiting or []) + [len(b.out)]
        b.out.append(Applied(True, "already rated that way", capture_id=ev.target, rating_id=current.id,
                             value=ev.value, train_model=current.train_model))
        return
    if current is not None:
        if current.new is not None:
            current.new.update(state="replaced", changed=now)
        else:
            assert current.id is not None  # a stored row: read with its id
            b.replaced.append((current.id, now))
    lineage = lineage_of(train_model, ev, conversation)
    row = _Active(None, ev.value, comment, stars, lineage, new={
        "event_id": ev.event_id, "capture_id": ev.target, "train_model": lineage, "actor": ev.actor,
        "source": ev.source, "value": ev.value, "comment": comment, "stars": stars, "state": "active",
        "adapter_version": version, "created": now, "changed": now,
    }, waiting=[len(b.out)])
    b.active[ev.target] = row
    b.new_ratings.append(row)
    b.out.append(Applied(True, rated(ev.value, current is not None, response, stars), capture_id=ev.target,
                         value=ev.value, train_model=lineage))


def _write(conn: Connection, b: _Batch) -> None:
    if b.claims:
        conn.execute(_CLAIM, b.claims)
    if b.new_caps:
        conn.execute(_ADD_CAPTURES, b.new_caps)
    if b.replaced:
        conn.execute(_REPLACE, [{"rid": rid, "changed": at} for rid, at in b.replaced])
    if b.new_ratings:
        got = conn.execute(_ADD_RATINGS, [r.new for r in b.new_ratings if r.new is not None])  # each has its values
        for row, (rid,) in zip(b.new_ratings, got, strict=True):
            for i in row.waiting or []:
                b.out[i] = replace(b.out[i], rating_id=rid)
