"""Replay of earlier ratings: which ones a run draws (pure numbers, then the store's pool on SQLite and
PostgreSQL), and a run through the queue that replays some without changing them."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from test_gate_runs import TOPICS, _prefer, gated_home  # noqa: F401 (a fixture)
from test_spine import _work_train_queue, opened_queue, rl, status
from test_store import MODEL, cap
from test_trainer import BAD, GOOD

from rlfleet.shared.events import Rating, Undo
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store
from rlfleet.worker.context import Context
from rlfleet.worker.orchestrate import replay_samples
from rlfleet.worker.replay import draw, wanted
from rlfleet.worker.training.advantages import update_ema

# ---- the draw --------------------------------------------------------------------------------------


def test_how_many_a_run_replays():
    assert wanted(32, 0.5) == 16 and wanted(3, 0.5) == 2 and wanted(1, 0.25) == 0 and wanted(10, 2.0) == 20
    assert wanted(32, 0.0) == 0  # 0 switches replay off
    assert wanted(0, 0.5) == 0  # a run of retractions alone replays nothing


def test_the_draw_balances_good_and_bad_and_takes_what_exists():
    pool = [(i, 1 if i % 4 == 0 else -1) for i in range(40)]  # 10 good, 30 bad
    values = dict(pool)
    picked = draw(pool, 8, run_id=7)
    assert len(picked) == 8 and len(set(picked)) == 8 and picked == sorted(picked)
    assert sum(values[i] > 0 for i in picked) == 4  # half and half, though good ones are rarer
    odd = draw(pool, 9, run_id=7)
    assert sum(values[i] > 0 for i in odd) == 5  # an odd one more good
    many = draw(pool, 30, run_id=7)
    assert sum(values[i] > 0 for i in many) == 10  # every good one; bad ones make up the rest
    assert len(many) == 30
    assert sorted(draw(pool, 100, run_id=7)) == list(range(40))  # capped by what exists
    only_bad = [(i, -1) for i in range(5)]
    assert draw(only_bad, 3, run_id=1) == sorted(draw(only_bad, 3, run_id=1)) and len(draw(only_bad, 3, 1)) == 3
    assert draw([], 5, run_id=1) == [] and draw(pool, 0, run_id=1) == []


def test_the_draw_repeats_for_a_run_id_whatever_the_pool_order():
    pool = [(i, 1 if i % 3 == 0 else -1) for i in range(200)]
    shuffled = pool[:]
    random.Random(5).shuffle(shuffled)
    assert draw(pool, 20, run_id=3) == draw(shuffled, 20, run_id=3)
    assert draw(pool, 20, run_id=3) != draw(pool, 20, run_id=4)  # another run, another sample


# ---- the store's pool ------------------------------------------------------------------------------


@pytest.fixture
def store(db_url):
    return Store(db_url)


def _rated(store, text: str, value: int) -> int:
    c = cap(text)
    store.apply_capture(c)
    return store.apply_rating(Rating(value=value, target=c.capture_id), MODEL).rating_id


def _run(store, advantages: dict[int, float], promote: bool = True) -> int:
    run = store.create_run(MODEL)
    store.start_run(run, None)
    store.finish_run(run, model=MODEL, version=f"v{run:04d}", parent=None, metrics={}, advantages=advantages,
                     retracted=[], new_ema=0.0, promote=promote)
    return run


def test_the_pool_is_the_active_ratings_a_promoted_run_of_this_lineage_trained_on(store):
    old = _rated(store, "from before the reset", 1)
    _run(store, {old: 1.0})
    store.reset(MODEL, purge_ratings=False)  # a fresh lineage forgets what the old one learned
    good, bad, undone = _rated(store, "liked", 1), _rated(store, "disliked", -1), _rated(store, "taken back", 1)
    _run(store, {good: 1.2, bad: -1.0, undone: 1.2})
    store.apply_undo(Undo())  # the newest rating, `undone`: now a retraction, never replayed
    rejected = _rated(store, "in a rejected run", 1)
    _run(store, {rejected: 1.2}, promote=False)  # consumed nothing: still pending
    pending = _rated(store, "not trained yet", -1)  # pending, as the gate's held-out ones are
    assert store.replay_pool(MODEL) == [(good, 1), (bad, -1)]
    assert store.replay_pool("another-model") == []
    rows = store.ratings_with_captures([bad, good])
    assert [(r.id, c.response) for r, c in rows] == [(good, "liked"), (bad, "disliked")]
    assert {r.id for r, _ in store.pending_ratings(MODEL, 10)} == {undone, rejected, pending}


# ---- through the queue, the worker and the CLI -------------------------------------------------------

MORE = ["clouds", "ferns", "lakes", "pines", "roads", "sand"]


def _trained(store: Store, ids) -> dict[int, tuple]:
    return {r.id: (r.state, r.run_id, r.advantage, r.retract_run_id) for r, _ in store.ratings_with_captures(ids)}


def test_a_run_replays_earlier_ratings_without_consuming_them(gated_home):  # noqa: F811 (the fixture)
    from peft import PeftModel

    from rlfleet.shared.models import load_model, resolve_model

    with opened_queue() as (cfg, handle):
        cfg.train.replay = 0.5  # off by default
        cfg.save()
        _prefer(cfg, handle, TOPICS[:6], GOOD, BAD)  # 12 ratings: 8 train v0001, 4 held out
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] == "v0001", st["training"]
        slug = st["model_slug"]
        reg = AdapterRegistry(cfg.adapters_root, slug)
        first = reg.meta("v0001")
        assert first["replayed_rating_ids"] == [] and first["metrics"]["replayed"] == 0  # nothing earlier yet
        store = Store(cfg.db_url)
        before = _trained(store, first["rating_ids"])

        _prefer(cfg, handle, MORE, GOOD, BAD)  # 12 more: with the 4 held out before, 16 pending
        _work_train_queue(handle)
        second = reg.meta("v0002")
        m = second["metrics"]
        replayed = second["replayed_rating_ids"]
        # Half the run's own fresh training ratings, from what v0001 trained on, good and bad alike.
        assert m["ratings_used"] == len(second["rating_ids"]) == 12 and m["replayed"] == len(replayed) == 6
        assert set(replayed) <= set(first["rating_ids"])
        assert set(replayed).isdisjoint(second["heldout_rating_ids"] + second["rating_ids"])
        values = {r.id: r.value for r, _ in store.ratings_with_captures(replayed)}
        assert sorted(values.values()) == [-1, -1, -1, 1, 1, 1]
        # The replayed ratings are still v0001's: the ledger did not touch them.
        assert _trained(store, first["rating_ids"]) == before
        # What the run consumes (or a forced promotion would) and the reward baseline: its own ratings only.
        assert {int(k) for k in second["advantages"]} == set(second["rating_ids"])
        fresh = {r.id: r.value for r, _ in store.ratings_with_captures(second["rating_ids"])}
        assert m["ema_after"] == pytest.approx(update_ema(m["ema_before"], [fresh[i] for i in second["rating_ids"]]))
        # It trained and was judged like any run; its adapter is a loadable peft folder.
        PeftModel.from_pretrained(load_model(resolve_model(cfg.model)), str(reg.path("v0002")))
        # Promoted: it consumed its own ratings; its held-out ones stay pending.
        assert reg.current() == "v0002" and m["verdict"] == "promoted", m
        assert store.pending_count(slug) == 4

        # The count shows where runs are listed: history (table and JSON) and the status object.
        hist = json.loads(rl("history", "--json").output)
        assert [h["replayed"] for h in hist] == [0, 6]
        assert "12 +6" in rl("history").output
        assert status()["adapter"]["versions"][1]["metrics"]["replayed"] == 6

        # The same run id draws the same ratings again; train.replay = 0 draws none.
        ctx = Context(cfg, store, slug, reg, 0.0)
        again = replay_samples(ctx, 99, 12)
        assert [s.rating_id for s in again] == [s.rating_id for s in replay_samples(ctx, 99, 12)]
        assert all(s.replayed and s.fixed_advantage is None for s in again) and len(again) == 6
        off = replace(ctx, cfg=ctx.cfg.model_copy(update={"train": ctx.cfg.train.model_copy(update={"replay": 0.0})}))
        assert replay_samples(off, 99, 12) == []
