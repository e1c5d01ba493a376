"""The events inbox and its drain (shared/inbox.py, worker/drain.py): batches apply exactly what one
event at a time would, in order; a dead drain's batch is applied again; a broken event is set aside
without holding up the rest; the drain hands over and lets go without stranding anything."""

from __future__ import annotations

import json
from dataclasses import astuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue, SimpleWorker
from sqlalchemy import delete, select
from typer.testing import CliRunner

from rlfleet.cli.app import app
from rlfleet.shared import applied as applied_mod
from rlfleet.shared import inbox
from rlfleet.shared.applied import Applied
from rlfleet.shared.config import load_config
from rlfleet.shared.errors import BadInput, NotFound
from rlfleet.shared.events import Capture, Command, Message, Rating, Undo
from rlfleet.shared.job_names import DRAIN_JOB
from rlfleet.shared.queue import EVENTS_QUEUE, enqueue_event, ensure_drain, open_queue, wait_for
from rlfleet.shared.schema import ProcessedEvent, RatingRow
from rlfleet.shared.store import Store

# ---- the store: one transaction for a batch == one per event -----------------------------------

OWNERS = ("ana", "bo")


def _capture(i: int, owner: str) -> Capture:
    return Capture(capture_id=f"c{i}", conversation="room", message_ref=f"m{i}", owner=owner,
                   prompt=[Message(role="user", content=f"q{i}")], response=f"answer {i}", model="m")


@st.composite
def event_streams(draw) -> list:
    """Captures, ratings (by id, message ref, or ``last``), undos, refusals and re-deliveries, mixed."""
    events: list = []
    n_caps = 0
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["capture", "rating", "rating", "rating", "undo", "again"]))
        actor = draw(st.sampled_from(OWNERS))
        target = draw(st.sampled_from(["last", "id", "ref", "nothing"]))
        i = draw(st.integers(0, max(n_caps, 1)))
        addr = {"last": "last", "id": f"c{i}", "ref": f"m{i}", "nothing": "c999"}[target]
        if kind == "capture":
            events.append(_capture(n_caps, actor))
            n_caps += 1
        elif kind == "rating":
            comment = draw(st.sampled_from([None, None, "meh"]))
            events.append(Rating(target=addr, actor=actor, conversation="room",
                                 value=draw(st.sampled_from([1, -1])), comment=comment))
        elif kind == "undo":
            events.append(Undo(actor=actor, conversation="room", target=None if target == "last" else addr,
                               value=draw(st.sampled_from([None, 1, -1]))))
        elif events:
            events.append(events[draw(st.integers(0, len(events) - 1))])  # delivered again
    return events


def _one_by_one(store: Store, events: list) -> list[Applied]:
    out = []
    for ev in events:
        try:
            if isinstance(ev, Capture):
                out.append(store.apply_capture(ev))
            elif isinstance(ev, Rating):
                out.append(store.apply_rating(ev, "m"))
            else:
                out.append(store.apply_undo(ev))
        except (BadInput, NotFound) as exc:
            out.append(Applied(False, str(exc)))
    return out


def _ratings(store: Store) -> list[tuple]:
    with store.session() as s:
        return [(r.event_id, r.capture_id, r.actor, r.value, r.comment, r.state)
                for r in s.scalars(select(RatingRow).order_by(RatingRow.id))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=event_streams(), cut=st.integers(1, 8))
def test_a_batch_does_exactly_what_one_event_at_a_time_does(tmp_path_factory, events, cut):
    d = tmp_path_factory.mktemp("db")
    alone, batched = Store(f"sqlite:///{d}/alone.db"), Store(f"sqlite:///{d}/batched.db")
    expected = _one_by_one(alone, events)
    got: list[Applied] = []
    for i in range(0, len(events), cut):  # batches of every size, cut anywhere in the stream
        got += batched.apply_many(events[i:i + cut], "m")
    assert [(a.ok, a.message, a.duplicate, a.capture_id, a.value) for a in got] == \
        [(a.ok, a.message, a.duplicate, a.capture_id, a.value) for a in expected]
    assert _ratings(batched) == _ratings(alone)
    assert [a.rating_id for a in got] == [a.rating_id for a in expected]


RATER = "cy"  # allowlisted: the ingress grants their ratings scope "any"


@st.composite
def plain_streams(draw) -> list:
    """The drain's common batch: ratings of stored answers by id (some by an allowlisted rater, some
    refused), re-ratings, re-deliveries, and captures now and then (one reusing a taken id)."""
    events: list = []
    n_caps = 4
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["rating", "rating", "rating", "rating", "capture", "again"]))
        if kind == "capture":
            events.append(_capture(draw(st.sampled_from([n_caps, 0])), draw(st.sampled_from(OWNERS))))
            n_caps += 1
        elif kind == "rating":
            actor = draw(st.sampled_from((*OWNERS, RATER)))
            events.append(Rating(target=f"c{draw(st.integers(0, 3))}", actor=actor, scope="any" if actor == RATER
                                 else "own", value=draw(st.sampled_from([1, -1])),
                                 comment=draw(st.sampled_from([None, "meh"]))))
        elif events:
            events.append(events[draw(st.integers(0, len(events) - 1))])
    return events


def _wipe(store: Store) -> None:
    with store.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("TRUNCATE ratings, captures, processed_events RESTART IDENTITY CASCADE")
        else:
            for table in ("ratings", "captures", "processed_events"):
                conn.exec_driver_sql(f"DELETE FROM {table}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=plain_streams(), cut=st.integers(1, 8))
def test_a_batch_of_plain_ratings_does_what_one_at_a_time_does_on_each_database(db_url, events, cut):
    store = Store(db_url)

    def run(batched: bool) -> tuple[list[tuple], list[tuple]]:
        _wipe(store)
        store.apply_many([_capture(i, OWNERS[i % 2]) for i in range(4)], "m")
        if batched:
            got = [a for i in range(0, len(events), cut) for a in store.apply_many(events[i:i + cut], "m")]
        else:
            got = [store.apply_one(ev, "m", refuse=False) for ev in events]
        return [astuple(a) for a in got], _ratings(store)

    assert run(batched=True) == run(batched=False)


# ---- the drain, through RQ ---------------------------------------------------------------------


def _work(handle) -> None:
    SimpleWorker([Queue(EVENTS_QUEUE, connection=handle.redis)], connection=handle.redis).work(
        burst=True, logging_level="WARNING")


@pytest.fixture
def q(queued_home):
    cfg = load_config(model="m")
    cfg.train.threshold = 10_000
    cfg.save()
    handle = open_queue(cfg)
    yield cfg, handle, Store(cfg.db_url)
    handle.close()


def test_one_drain_applies_a_burst_in_order_and_answers_each_event(q):
    cfg, handle, store = q
    cap = _capture(1, "local")
    events = [cap, Rating(target="c1", value=1), Rating(target="c1", value=-1), Undo(target="c1"),
              Rating(target="c1", value=1), Rating(target="c404", value=1), Command(name="status")]
    tickets = [enqueue_event(handle, ev) for ev in events]
    assert handle.waiting_events() == len(events) and handle.events.count == 1  # one drain job, not seven
    status = CliRunner().invoke(app, ["status", "--json"])
    assert json.loads(status.output)["queue"]["events"] == len(events)  # events, not events + the drain job
    _work(handle)
    answers = [wait_for(t, 0) for t in tickets]
    assert [a["ok"] for a in answers] == [True, True, True, True, True, False, True]
    assert answers[2]["message"].startswith("re-rated bad") and answers[3]["message"] == "undid your bad rating"
    assert answers[5] == {"ok": False, "message": "no captured answer with id or message ref 'c404'"}
    assert answers[6]["status"]["ratings"]["good"] == 1  # the command saw every event sent before it
    assert [r[3:] for r in _ratings(store)] == [(1, None, "replaced"), (-1, None, "undone"), (1, None, "active")]
    assert handle.waiting_events() == 0 and not handle.redis.exists(inbox.OWNER)  # let go when empty


def test_a_drain_killed_mid_batch_leaves_it_for_the_next(q):
    cfg, handle, store = q
    store.apply_capture(_capture(1, "local"))
    tickets = [enqueue_event(handle, Rating(target="c1", value=v)) for v in (1, -1, 1)]
    handle.redis.delete(*handle.redis.keys("rq:*"))  # its drain job is gone (killed, and lost)
    assert inbox.take(handle.redis, handle.redis.get(inbox.OWNER).decode()).items  # ... after taking the batch
    assert handle.redis.llen(inbox.TAKEN) == 3 and not _ratings(store)
    assert ensure_drain(handle.redis)  # what a worker checks as it starts and between jobs
    _work(handle)
    assert [r[3] for r in _ratings(store)] == [1, -1, 1] and [wait_for(t, 0)["ok"] for t in tickets] == [True] * 3
    assert handle.waiting_events() == 0
    # the same batch applied once more (a drain killed after the commit, before emptying TAKEN) is a no-op
    handle.redis.rpush(inbox.INBOX, *[Rating(target="c1", value=1, event_id=r[0]).model_dump_json()
                                      for r in _ratings(store)])
    ensure_drain(handle.redis)
    _work(handle)
    assert len(_ratings(store)) == 3


def test_a_batch_whose_commit_never_reached_the_disk_is_applied_again_from_redis(q, monkeypatch):
    cfg, handle, store = q
    for i in range(3):
        store.apply_capture(_capture(i, "local"))
    real_sync = Store.sync

    def disk_gone(self) -> None:
        raise OSError("the disk went away")

    monkeypatch.setattr(Store, "sync", disk_gone)
    tickets = [enqueue_event(handle, Rating(target=f"c{i}", value=1)) for i in range(3)]
    _work(handle)  # applies and answers, cannot sync: the drain fails and keeps the batch in Redis
    assert [wait_for(t, 0)["ok"] for t in tickets] == [True] * 3
    assert inbox.unsynced(handle.redis) and handle.waiting_events() == 0
    with store.session() as s:  # the power cut: the commits that were not on disk are gone
        s.execute(delete(RatingRow))
        s.execute(delete(ProcessedEvent).where(ProcessedEvent.kind == "rating"))
    assert not _ratings(store)
    monkeypatch.setattr(Store, "sync", real_sync)
    handle.redis.delete(*handle.redis.keys("rq:*"))  # and the failed drain's retry with it
    assert ensure_drain(handle.redis)  # what a worker checks as it starts
    _work(handle)
    assert sorted(r[0] for r in _ratings(store)) == sorted(t.event_id for t in tickets)  # back, once each
    assert not inbox.unsynced(handle.redis) and not handle.redis.keys(inbox.UNSYNCED_BATCH + "*")


def test_a_command_is_carried_out_once_even_if_its_batch_is_applied_again(q):
    cfg, handle, store = q
    cmd = Command(name="rollback", args={"version": "base"})
    first = enqueue_event(handle, cmd)
    _work(handle)
    assert wait_for(first, 0)["message"] == "already on the base model"  # carried out (nothing to change)
    again = enqueue_event(handle, cmd)
    _work(handle)
    assert "already carried out" in wait_for(again, 0)["message"]


def test_a_broken_event_is_set_aside_and_the_rest_go_on(q, monkeypatch):
    cfg, handle, store = q
    store.apply_capture(_capture(1, "local"))
    store.apply_capture(_capture(2, "local"))
    bad = Rating(target="c2", value=-1)  # the only rating of c2, whose answer the bug trips on
    real = applied_mod.preview

    def breaks_on_one(text: str, *args) -> str:
        if text == "answer 2":
            raise RuntimeError("a bug on this one event")
        return real(text, *args)

    monkeypatch.setattr(applied_mod, "preview", breaks_on_one)
    before, after = Rating(target="c1", value=1), Rating(target="c1", value=-1)
    tickets = [enqueue_event(handle, ev) for ev in (before, bad, after)]
    handle.redis.rpush(inbox.INBOX, b"\xff not an event")  # not from a producer of ours
    _work(handle)
    answers = [wait_for(t, 0) for t in tickets]
    assert answers[0]["ok"] and answers[2]["ok"]
    assert not answers[1]["ok"] and "5 times" in answers[1]["message"]
    assert "a bug on this one event" in answers[1]["message"]
    assert [r[3:] for r in _ratings(store)] == [(1, None, "replaced"), (-1, None, "active")]
    aside = inbox.dead(handle.redis)
    assert len(aside) == 2 and aside[0]["event"].endswith("not an event")  # set aside at once: unreadable
    assert json.loads(aside[1]["event"])["event_id"] == bad.event_id and "a bug" in aside[1]["error"]
    assert handle.waiting_events() == 0

    res = CliRunner().invoke(app, ["events", "--dead", "--json"])
    shown = json.loads(res.output)
    assert res.exit_code == 0 and shown["set_aside"] == 2
    assert shown["dead"][0]["type"] == "unreadable" and shown["dead"][1]["event_id"] == bad.event_id
    assert "answer" not in res.output  # which event and why, not the user's text

    monkeypatch.setattr(applied_mod, "preview", real)  # the cause is fixed: put them back
    res = CliRunner().invoke(app, ["events", "--retry", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["requeued"] == 2
    # no worker runs here: the command applied them itself, as `rlfleet good` does
    assert [r[0] for r in _ratings(store)][-1] == bad.event_id
    assert len(inbox.dead(handle.redis)) == 1  # the unreadable entry again, and only it


def test_a_database_outage_fails_the_drain_not_the_events(q, monkeypatch):
    from sqlalchemy.exc import OperationalError

    cfg, handle, store = q
    store.apply_capture(_capture(1, "local"))

    def down(*_a, **_k):
        raise OperationalError("SELECT 1", {}, Exception("database is locked"))

    real = Store.apply_many
    monkeypatch.setattr(Store, "apply_many", down)
    ticket = enqueue_event(handle, Rating(target="c1", value=1))
    _work(handle)
    assert wait_for(ticket, 0) is None and handle.redis.llen(inbox.TAKEN) == 1  # kept, for the retry
    assert not inbox.dead(handle.redis)
    monkeypatch.setattr(Store, "apply_many", real)  # the database is back
    owner = handle.redis.get(inbox.OWNER).decode()
    Queue(EVENTS_QUEUE, connection=handle.redis).enqueue_call(DRAIN_JOB, job_id=owner)  # RQ's retry
    _work(handle)
    assert wait_for(ticket, 0)["ok"] and len(_ratings(store)) == 1


def test_a_long_drain_hands_over_and_nothing_is_stranded(q, monkeypatch):
    import rlfleet.worker.drain_job as drain_job

    cfg, handle, store = q
    monkeypatch.setattr(drain_job, "DRAIN_SECONDS", 0.0)  # hand over after every batch
    monkeypatch.setattr(inbox, "BATCH", 7)
    for i in range(40):
        store.apply_capture(_capture(i, "local"))
    tickets = [enqueue_event(handle, Rating(target=f"c{i}", value=1)) for i in range(40)]
    _work(handle)
    assert all(wait_for(t, 0)["ok"] for t in tickets) and len(_ratings(store)) == 40
    assert handle.waiting_events() == 0 and not handle.redis.exists(inbox.OWNER)


def test_an_event_that_arrives_as_the_drain_lets_go_is_not_stranded(q):
    cfg, handle, store = q
    conn = handle.redis
    store.apply_capture(_capture(1, "local"))
    owner = inbox.new_drain_id()
    assert inbox.take(conn, owner).items == []  # a drain that found the inbox empty, about to let go
    late = enqueue_event(handle, Rating(target="c1", value=-1))  # appended meanwhile
    assert handle.events.count == 0  # no second drain was queued for it ...
    assert not inbox.release(conn, owner)  # ... and the owner sees it as it tries to let go, and goes on
    Queue(EVENTS_QUEUE, connection=conn).enqueue_call(DRAIN_JOB, job_id=owner)
    _work(handle)
    assert wait_for(late, 0)["ok"] and handle.waiting_events() == 0


def test_a_mixed_batch_on_each_database(db_url):
    store = Store(db_url)
    first = Rating(target="m0", actor="ana", conversation="room", value=1)
    events = [_capture(0, "ana"), first, Rating(target="c0", actor="ana", conversation="room", value=-1), first,
              Rating(target="c404", actor="ana", value=1), Rating(target="c0", actor="bo", value=1),
              Undo(actor="ana", conversation="room"), _capture(1, "ana"),
              Rating(target="last", actor="ana", conversation="room", value=1)]
    got = store.apply_many(events, "m")
    assert [(a.ok, a.duplicate) for a in got] == [(True, False), (True, False), (True, False), (True, True),
                                                  (False, False), (False, False), (True, False), (True, False),
                                                  (True, False)]
    assert got[5].message == "nothing of yours to rate here"  # bo is neither the owner nor allowlisted
    assert [r[1:] for r in _ratings(store)] == [("c0", "ana", 1, None, "replaced"), ("c0", "ana", -1, None, "undone"),
                                                ("c1", "ana", 1, None, "active")]
    ids = [a.rating_id for a in got]
    assert ids[1] < ids[2] < ids[8] and ids[6] == ids[2]  # the undo names the rating it took back
    assert store.apply_many(events, "m")[1].duplicate  # the whole batch again: nothing new
    assert len(_ratings(store)) == 3


def test_every_push_rings_the_doorbell_a_waiting_drain_listens_on(q):
    cfg, handle, store = q
    bell = inbox.Doorbell(handle.redis)
    try:
        assert bell.sub.get_message(timeout=0) is None  # nothing rang yet
        enqueue_event(handle, Rating(target="c1", value=1))
        enqueue_event(handle, Rating(target="c1", value=-1))
        ring = bell.sub.get_message(timeout=5)
        assert ring is not None and ring["channel"] == inbox.BELL.encode()
        bell.wait(0)  # wakes on the second ring at once and takes every ring that waited
        assert bell.sub.get_message(timeout=0) is None
    finally:
        bell.close()


def test_training_is_queued_by_the_rating_that_reaches_the_threshold_batch_after_batch(q, monkeypatch):
    """The drain counts its own ratings down to the threshold instead of asking the database every
    batch; an undo on the way (one pending rating fewer) must not make it trigger early or late."""
    cfg, handle, store = q
    cfg.train.threshold = 5
    cfg.save()
    monkeypatch.setattr(inbox, "BATCH", 1)  # one event per batch: the countdown runs on every one
    for i in range(6):
        store.apply_capture(_capture(i, "local"))
    events = [Rating(target=f"c{i}", value=1) for i in range(4)]
    events += [Undo(target="c3"), Rating(target="c4", value=1), Rating(target="c5", value=-1)]
    tickets = [enqueue_event(handle, ev) for ev in events]
    _work(handle)
    training = [wait_for(t, 0).get("training") for t in tickets]
    assert training[:6] == [None] * 6
    assert training[6] is not None and training[6].startswith("training run") and "on 5 ratings" in training[6]
