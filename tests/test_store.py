"""The store on SQLite and PostgreSQL: idempotent events, rating rules, pending accounting."""

import pytest

from rlfleet.shared.errors import NotFound
from rlfleet.shared.events import Capture, Rating, Undo
from rlfleet.shared.schema import CaptureRow
from rlfleet.shared.store import Store

MODEL = "tiny"


@pytest.fixture
def store(db_url):
    return Store(db_url)


def cap(text="answer", owner="local", ref=None, conv="c1"):
    return Capture(prompt=[{"role": "user", "content": "q " + text}], response=text, model="m", owner=owner,
                   message_ref=ref, conversation=conv)


def test_capture_and_rating_are_idempotent_on_event_id(store):
    c = cap()
    assert store.apply_capture(c).ok
    again = store.apply_capture(c)
    assert again.duplicate
    r = Rating(value=1, target=c.capture_id)
    first = store.apply_rating(r, MODEL)
    assert first.ok and not first.duplicate
    assert store.apply_rating(r, MODEL).duplicate
    assert store.counts(MODEL).total == 1


def test_rating_last_uses_the_actors_latest_capture(store):
    a, b = cap("first"), cap("second")
    store.apply_capture(a)
    store.apply_capture(b)
    res = store.apply_rating(Rating(value=-1), MODEL)
    assert res.capture_id == b.capture_id


def test_rating_by_message_ref(store):
    c = cap(ref="slack:123.456")
    store.apply_capture(c)
    assert store.apply_rating(Rating(value=1, target="slack:123.456"), MODEL).capture_id == c.capture_id


def test_unknown_target_changes_nothing(store):
    with pytest.raises(NotFound):
        store.apply_rating(Rating(value=1, target="no-such-ref"), MODEL)
    assert store.counts(MODEL).total == 0


def test_other_peoples_answers_are_rateable_only_in_a_rating_of_scope_any(store):
    c = cap(owner="alice")
    store.apply_capture(c)
    with pytest.raises(NotFound, match="nothing of yours"):
        store.apply_rating(Rating(value=1, target=c.capture_id, actor="mallory"), MODEL)
    ok = store.apply_rating(Rating(value=1, target=c.capture_id, actor="bob", scope="any"), MODEL)  # a rater's
    assert ok.ok


def test_rerating_replaces_and_undo_removes(store):
    c = cap()
    store.apply_capture(c)
    store.apply_rating(Rating(value=1, target=c.capture_id), MODEL)
    store.apply_rating(Rating(value=-1, target=c.capture_id), MODEL)
    counts = store.counts(MODEL)
    assert (counts.total, counts.good, counts.bad, counts.pending) == (1, 0, 1, 1)
    undone = store.apply_undo(Undo())
    assert undone.ok and undone.value == -1
    assert store.counts(MODEL).total == 0
    with pytest.raises(NotFound):
        store.apply_undo(Undo())


@pytest.mark.parametrize("batched", [False, True])
def test_the_same_thumb_again_without_words_keeps_the_words_and_stars_a_change_of_thumb_drops_them(store, batched):
    """A 👎 button clicked after `/rl 2 too long` (or a 👎 reaction after it) says nothing new: the
    comment and the stars stay; a 👍 then is another opinion, and the 👎's words go with it."""
    def rate(**kw):
        ev = Rating(target=c.capture_id, **kw)
        return store.apply_many([ev], MODEL)[0] if batched else store.apply_rating(ev, MODEL)

    def active():
        return [(r.value, r.comment, r.stars) for r, _ in store.rated_pairs(MODEL)]

    c = cap()
    store.apply_capture(c)
    rate(value=-1, comment="too long", stars=2)
    again = rate(value=-1)
    assert active() == [(-1, "too long", 2)] and again.message == "already rated that way"
    rate(value=-1, comment="and wrong")  # new words replace the old ones; the stars stay
    assert active() == [(-1, "and wrong", 2)]
    rate(value=1)
    assert active() == [(1, None, None)]
    rate(value=1, stars=5)
    rate(value=1)
    assert active() == [(1, None, 5)]


def test_unrated_prompts_are_the_newest_answers_without_an_active_rating(store):
    import time

    a, b, c, d = cap("a"), cap("b"), cap("c"), cap("d")
    for one in (a, b, c, d):
        store.apply_capture(one)
        time.sleep(0.01)  # distinct creation times: newest first is then one order
    store.apply_rating(Rating(value=1, target=b.capture_id), MODEL)
    store.apply_rating(Rating(value=-1, target=d.capture_id), MODEL)
    store.apply_undo(Undo())  # d's rating undone: unrated again
    asked = [[{"role": "user", "content": f"q {x}"}] for x in "dca"]
    assert store.unrated_prompts(10) == asked
    assert store.unrated_prompts(1) == asked[:1]
    assert store.unrated_prompts(0) == []


def test_trained_then_undone_rating_comes_back_as_a_retraction(store):
    c = cap()
    store.apply_capture(c)
    rid = store.apply_rating(Rating(value=1, target=c.capture_id), MODEL).rating_id
    run = store.create_run(MODEL)
    store.start_run(run, None)
    status = store.finish_run(run, model=MODEL, version="v0001", parent=None, metrics={}, advantages={rid: 0.7},
                              retracted=[], new_ema=0.5, promote=True)
    assert status == "active"
    assert store.pending_count(MODEL) == 0 and store.pending_ratings(MODEL, 10) == []
    store.apply_undo(Undo())
    pending = store.pending_ratings(MODEL, 10)
    assert [(r.id, r.state, r.advantage) for r, _ in pending] == [(rid, "undone", 0.7)]
    assert store.baseline(MODEL) == (0.5, 0)


def test_the_ratings_browser_reads_a_version_and_a_source_as_people_type_them(store):
    from rlfleet.shared.store import RatingFilter

    c = Capture(prompt=[{"role": "user", "content": "q"}], response="a", model="m", owner="U1", source="slack")
    store.apply_capture(c)
    rid = store.apply_rating(Rating(value=1, target=c.capture_id, source="slack", actor="U1"), MODEL).rating_id
    run = store.create_run(MODEL)
    store.start_run(run, None)
    store.finish_run(run, model=MODEL, version="v0001", parent=None, metrics={}, advantages={rid: 0.5},
                     retracted=[], new_ema=0.5, promote=True)
    for f, n in [(RatingFilter(version="v1"), 1), (RatingFilter(version=" 1 "), 1), (RatingFilter(version="v0001"), 1),
                 (RatingFilter(version="v2"), 0), (RatingFilter(version="Pending"), 0),
                 (RatingFilter(source="Slack"), 1), (RatingFilter(source="web"), 0), (RatingFilter(actor=" U1"), 1)]:
        assert store.browse_ratings(MODEL, f)[0] == n, f


def test_rejected_run_consumes_nothing(store):
    c = cap()
    store.apply_capture(c)
    rid = store.apply_rating(Rating(value=1, target=c.capture_id), MODEL).rating_id
    run = store.create_run(MODEL)
    status = store.finish_run(run, model=MODEL, version="v0001", parent=None, metrics={}, advantages={rid: 1.0},
                              retracted=[], new_ema=1.0, promote=False, reason="kl too high")
    assert status == "rejected"
    assert store.pending_count(MODEL) == 1
    assert store.baseline(MODEL) == (None, 0)


def test_reset_during_a_run_makes_its_version_stale(store):
    run = store.create_run(MODEL)
    store.reset(MODEL, purge_ratings=False)
    status = store.finish_run(run, model=MODEL, version="v0001", parent=None, metrics={}, advantages={},
                              retracted=[], new_ema=0.0, promote=True)
    assert status == "stale"


def test_reset_with_purge_deletes_ratings(store):
    c = cap()
    store.apply_capture(c)
    store.apply_rating(Rating(value=1, target=c.capture_id), MODEL)
    assert store.reset(MODEL, purge_ratings=True) == 1
    assert store.counts(MODEL).total == 0


def test_a_reason_said_afterwards_keeps_the_rating_and_takes_its_words(store):
    first, second, strangers = cap("first"), cap("second"), cap("theirs", owner="u2")
    for c in (first, second, strangers):
        store.apply_capture(c)
    with pytest.raises(NotFound, match="nothing you rated here yet"):
        store.apply_rating(Rating(value=None, comment="too long"), MODEL)
    store.apply_rating(Rating(value=-1, target=first.capture_id), MODEL)
    said = store.apply_rating(Rating(value=None, comment="too long"), MODEL)  # the answer last rated, not the newest
    assert said.ok and said.capture_id == first.capture_id and said.value == -1
    assert said.message == "noted why it is bad: too long"
    changed = store.apply_rating(Rating(value=None, comment="far too long", target=first.capture_id), MODEL)
    assert changed.ok and changed.value == -1
    with pytest.raises(NotFound, match="you have not rated that answer"):
        store.apply_rating(Rating(value=None, comment="meh", target=second.capture_id), MODEL)
    store.apply_rating(Rating(actor="u2", value=1, target=strangers.capture_id), MODEL)
    with pytest.raises(NotFound, match="you have not rated that answer"):  # another rater's rating is theirs
        store.apply_rating(Rating(value=None, comment="meh", target=strangers.capture_id, scope="any"), MODEL)
    assert [(r.value, r.comment, r.state) for r, c in store.rated_pairs(all_states=True)
            if c.id == first.capture_id] == [(-1, None, "replaced"), (-1, "too long", "replaced"),
                                             (-1, "far too long", "active")]
    assert store.counts(MODEL).total == 2  # one rating per answer still


def test_a_reason_needs_words():
    with pytest.raises(ValueError, match="needs words"):
        Rating(value=None, comment="  ")


def test_migrations_are_reentrant(db_url):
    Store(db_url)
    Store(db_url)  # a second open finds the schema at head and changes nothing

OLD_CAPTURE = ("INSERT INTO captures (id, event_id, source, conversation, owner, prompt, response, model, created) "
               "VALUES ('old', 'ev-old', 'cli', 'c1', 'local', '[]', 'an old answer', 'm', '2026-11-01 00:00:00')")


def database_at(db_url: str, revision: str, *inserts: str) -> None:
    """A database as an older release left it: the schema migrated up to ``revision`` only, with
    ``inserts`` (SQL) run on it; the next Store migrates the rest."""
    import sqlalchemy as sa
    from alembic import command
    from alembic.config import Config as AlembicConfig

    from rlfleet.shared.engines import MIGRATIONS

    engine = sa.create_engine(db_url)
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        for sql in inserts:
            conn.execute(sa.text(sql))
    engine.dispose()


def test_a_database_from_before_finish_reason_keeps_its_answers_as_ended(db_url):
    """A data dir made by the release before captures said how an answer ended: the next start migrates
    it, its captures read as not known (they train as ended, as before), and new ones record it."""
    database_at(db_url, "0002", OLD_CAPTURE)
    store = Store(db_url)
    cut = Capture(prompt=[{"role": "user", "content": "q"}], response="a", model="m", finish_reason="length")
    assert store.apply_capture(cut).ok
    with store.session() as s:
        assert {c.id: c.finish_reason for c in s.query(CaptureRow)} == {"old": None, cut.capture_id: "length"}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # a server that can drop connections
def test_a_connection_the_database_dropped_is_replaced_after_a_pause(db_url, monkeypatch, request):
    import sqlalchemy as sa

    from rlfleet.shared import engines

    monkeypatch.setattr(engines, "PING_AFTER_IDLE_S", 0.0)  # every checkout counts as after a pause
    store = Store(db_url)
    c = cap()
    store.apply_capture(c)
    admin = sa.create_engine(request.getfixturevalue("pg_admin_url"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # what a server restart does to the pooled connection
        dropped = conn.execute(sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                       "WHERE datname = :db"), {"db": db_url.rsplit("/", 1)[1]}).scalar()
    admin.dispose()
    assert dropped == 1
    assert store.apply_many([Rating(target=c.capture_id, value=1)], MODEL)[0].ok  # the ping found it gone


def test_a_deferred_commit_leaves_every_other_transaction_waiting_for_the_disk(store):
    from sqlalchemy import text

    c = cap()
    store.apply_capture(c)
    assert store.apply_many([Rating(value=1, target=c.capture_id)], MODEL, durable=False)[0].ok
    store.sync()  # every commit before it on disk; nothing to assert about a disk from here but that it ran
    setting = "PRAGMA synchronous" if store.engine.dialect.name == "sqlite" else "SHOW synchronous_commit"
    for _ in range(3):  # whichever pooled connection comes next
        with store.session() as s:
            assert str(s.execute(text(setting)).scalar()) in ("2", "on")  # FULL / on, as by default
        with store.session(durable=False) as s:
            assert str(s.execute(text(setting)).scalar()) in ("1", "off")  # NORMAL / off: waits for sync()
    assert store.counts(MODEL).total == 1


def test_stars_are_stored_beside_the_thumb_and_a_reason_keeps_them(store):
    first, second = cap(), cap()
    for c in (first, second):
        store.apply_capture(c)
    said = store.apply_rating(Rating(target=first.capture_id, stars=4), MODEL)
    assert said.ok and said.message.startswith("rated good (4★)") and said.value == 1
    assert store.apply_rating(Rating(target=first.capture_id, stars=4), MODEL).message == "already rated that way"
    store.apply_rating(Rating(target=first.capture_id, stars=5), MODEL)  # more stars: re-rated
    store.apply_rating(Rating(value=None, comment="spot on", target=first.capture_id), MODEL)
    store.apply_rating(Rating(target=second.capture_id, value=1), MODEL)  # a bare thumb has none
    store.apply_many([Rating(target=second.capture_id, stars=2, comment="wrong")], MODEL)  # the fast path too
    rows = [(c.id == first.capture_id, r.value, r.stars, r.comment, r.state)
            for r, c in store.rated_pairs(all_states=True)]
    assert rows == [(True, 1, 4, None, "replaced"), (True, 1, 5, None, "replaced"), (True, 1, 5, "spot on", "active"),
                    (False, 1, None, None, "replaced"), (False, -1, 2, "wrong", "active")]
    assert store.stars_given(MODEL) == {"local": [5, 2]}


def test_stars_must_agree_with_the_thumb_and_stay_within_one_to_five():
    assert Rating(stars=4).value == 1 and Rating(stars=3).value == -1
    with pytest.raises(ValueError, match="2 stars is a thumbs-down"):
        Rating(stars=2, value=1)
    for bad in (0, 6):
        with pytest.raises(ValueError):
            Rating(stars=bad)


def test_a_database_from_before_stars_keeps_its_ratings_as_bare_thumbs(db_url):
    database_at(db_url, "0003", OLD_CAPTURE,
                "INSERT INTO ratings (event_id, capture_id, train_model, actor, source, value, state, created, "
                "changed) VALUES ('r-old', 'old', 'm', 'local', 'cli', 1, 'active', '2026-11-01 00:00:00', "
                "'2026-11-01 00:00:00')")
    store = Store(db_url)
    new = cap()
    store.apply_capture(new)
    assert store.apply_rating(Rating(target=new.capture_id, stars=1), MODEL).ok
    assert sorted((r.capture_id == "old", r.stars) for r, _ in store.rated_pairs()) == [(False, 1), (True, None)]


def test_a_pause_is_kept_in_the_database_per_model_and_outlives_a_reset(db_url):
    store = Store(db_url)
    assert store.training_paused(MODEL) is False  # a model nothing was said of trains by itself
    assert store.pause_training(MODEL, True) is True
    assert store.pause_training(MODEL, True) is False  # already paused: nothing changed
    restarted = Store(db_url)  # another process, or the same worker after a restart
    assert restarted.training_paused(MODEL) is True and restarted.training_paused("other") is False
    store.reset(MODEL, purge_ratings=False)  # a fresh lineage does not undo an admin's pause
    assert restarted.training_paused(MODEL) is True
    assert restarted.pause_training(MODEL, False) is True and store.training_paused(MODEL) is False


def test_a_database_from_before_pause_trains_by_itself_and_keeps_its_baseline(db_url):
    database_at(db_url, "0004", "INSERT INTO baselines (model, ema, count, lineage) VALUES ('tiny', 0.5, 3, 1)")
    store = Store(db_url)
    assert store.training_paused(MODEL) is False and store.baseline(MODEL) == (0.5, 1)
    store.pause_training(MODEL, True)
    assert store.training_paused(MODEL) is True and store.baseline(MODEL) == (0.5, 1)


def test_an_agents_step_keeps_its_reward_and_is_never_a_chat_rating_to_train(store, db_url):
    people, step = cap(), Capture(source="gym", owner="blackjack", actor="blackjack", conversation="blackjack/e1",
                                  message_ref="blackjack/e1:0", prompt=[{"role": "user", "content": "sum 14"}],
                                  response="Action: 1", model=MODEL)
    store.apply_many([people, step], MODEL)
    store.apply_many([Rating(target=people.capture_id, value=1),
                      Rating(source="gym", actor="blackjack", target=step.capture_id, value=-1, reward=-1.0)], MODEL)
    assert store.pending_count(MODEL) == 1  # people's rating only
    assert [c.id for _, c in store.pending_ratings(MODEL, 10)] == [people.capture_id]
    assert [(r.reward, c.id) for r, c in store.untrained_steps(MODEL, "blackjack")] == [(-1.0, step.capture_id)]
    assert store.untrained_steps(MODEL, "local") == []
    # a reason said afterwards keeps the step's reward, as it keeps stars
    store.apply_rating(Rating(source="gym", actor="blackjack", value=None, comment="busted", target=step.capture_id),
                       MODEL)
    assert [(r.reward, r.comment) for r, _ in store.untrained_steps(MODEL, "blackjack")] == [(-1.0, "busted")]


def test_a_reward_belongs_to_an_agents_step_and_is_a_finite_number():
    assert Rating(source="gym", value=1, reward=0.5).reward == 0.5
    for bad in [{"source": "slack", "value": 1, "reward": 1.0}, {"source": "gym", "value": None, "comment": "x",
                                                                  "reward": 1.0},
                {"source": "gym", "value": 1, "reward": float("nan")}, {"source": "gym", "value": 1, "reward": "lots"},
                {"source": "gym", "value": -1, "reward": float("inf")}]:
        with pytest.raises(ValueError):
            Rating(**bad)


def test_a_database_from_before_rewards_migrates_with_its_ratings_as_peoples(db_url):
    database_at(db_url, "0005", OLD_CAPTURE,
                "INSERT INTO ratings (event_id, capture_id, train_model, actor, source, value, state, created, "
                "changed) VALUES ('r-old', 'old', 'm', 'local', 'cli', 1, 'active', '2026-11-01 00:00:00', "
                "'2026-11-01 00:00:00')")
    store = Store(db_url)
    assert store.pending_count("m") == 1 and [r.reward for r, _ in store.pending_ratings("m", 5)] == [None]


def test_forgetting_a_person_says_which_adapters_already_learned_from_them(store, tmp_path):
    from sqlalchemy import update

    from rlfleet.shared.forget import forget
    from rlfleet.shared.schema import RatingRow

    mine, theirs, other = cap(owner="local"), cap(owner="bob"), cap(owner="carol")
    for c in (mine, theirs, other):
        store.apply_capture(c)
    store.apply_rating(Rating(target=mine.capture_id, value=1), MODEL)  # local's own answer
    store.apply_rating(Rating(actor="local", target=theirs.capture_id, value=-1, scope="any"), MODEL)
    store.apply_rating(Rating(actor="carol", target=other.capture_id, value=1), MODEL)
    run = store.create_run(MODEL)
    with store.session() as s:  # a shared run trained on local's two ratings
        s.execute(update(RatingRow).where(RatingRow.actor == "local").values(run_id=run))
    done = forget(store, tmp_path, MODEL, "cli", "local")
    assert (done.ratings, done.captures, done.versions) == (2, 1, [])
    assert done.trained_elsewhere == {MODEL: 2} and "keep what they learned" in done.message()
    assert [(r.actor, c.owner) for r, c in store.rated_pairs(all_states=True)] == [("carol", "carol")]
    with store.session() as s:
        assert {c.owner for c in s.query(CaptureRow)} == {"bob", "carol"}  # bob's answer stays, unrated


def test_close_lets_go_of_the_database_files_and_the_store_still_works(tmp_path):
    import os

    def open_files() -> set[str]:
        names = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return {n for n in names if n.startswith(str(tmp_path))}

    store = Store(f"sqlite:///{tmp_path}/close.db")
    store.apply_capture(cap())
    with store.session(durable=False) as s:  # the deferred engine too
        s.get(CaptureRow, "c-1")
    assert open_files(), "the test reads nothing: sqlite holds no file open"
    store.close()
    assert open_files() == set()
    assert store.apply_capture(cap(text="again", ref="r2")).ok  # opens what it needs again
    store.close()
    assert open_files() == set()
