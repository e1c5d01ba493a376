"""Between runs the training worker pools the earlier ratings' answers under the served version, and
the next run's reward model reads them instead of running the model over them again
(worker/idle_work.py, worker/training/feature_memo.py)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
from test_gate_runs import BAD, GOOD, TOPICS, _prefer, gated_home  # noqa: F401 (a fixture)
from test_spine import _work_train_queue, opened_queue, status
from test_trainer import LEARN, preference_samples

from rlfleet.shared.config import load_config
from rlfleet.shared.models import model_slug
from rlfleet.worker import idle_work
from rlfleet.worker.batching import encode_sample
from rlfleet.worker.idle_work import LEASE, IdleWorker, warm_features
from rlfleet.worker.presets import for_trainer
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.trainer_cache import get_trainer
from rlfleet.worker.training import exploration, feature_memo, reward_features


def test_remembered_features_are_the_ones_a_pass_computes(tiny_trainer, tmp_path):
    samples = preference_samples()[:12]
    feature_memo.forget(tiny_trainer)
    with tiny_trainer.adapter(None, LEARN, trainable=True, precision="fp32"):
        rows = feature_memo.rows_for(tiny_trainer, None, tiny_trainer.precision)
        assert reward_features.remember(tiny_trainer, samples[:8], 96, rows, stop=lambda: True) == 0
        assert reward_features.remember(tiny_trainer, samples[:8], 96, rows) == 8
        assert reward_features.remember(tiny_trainer, samples[:8], 96, rows) == 0  # nothing twice
        fresh = reward_features.features(tiny_trainer, samples, 96)
        read, n_known = reward_features._features(tiny_trainer, samples, 96, rows)
        assert n_known == 8
        # Another batch around a row moves its float sums by rounding only.
        assert np.allclose(read, fresh, atol=1e-5) and not np.array_equal(read[:8], np.zeros_like(read[:8]))
        report = reward_features.measure(tiny_trainer, samples, 96, 0, rows)
        assert report.known == 8 and report.metrics()["reward_model_known"] == 8
        assert report.auc == reward_features.measure(tiny_trainer, samples, 96, 0).auc

        # Rows of another model are not these: an adapter folder, another precision.
        tiny_trainer.save(tmp_path / "v1")
    assert feature_memo.rows_for(tiny_trainer, None, "fp32") is rows
    assert feature_memo.rows_for(tiny_trainer, None, "bf16") == {}
    assert feature_memo.rows_for(tiny_trainer, tmp_path / "v1", "fp32") == {}
    feature_memo.rows_for(tiny_trainer, tmp_path / "v1", "fp32")[(0, (1,))] = [1.0]
    before = feature_memo.identity(tmp_path / "v1", "fp32")
    weights = tmp_path / "v1" / feature_memo.ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes() + b" ")  # the folder written again (after a reset, say)
    assert feature_memo.identity(tmp_path / "v1", "fp32") != before
    assert feature_memo.rows_for(tiny_trainer, tmp_path / "v1", "fp32") == {}
    feature_memo.forget(tiny_trainer)


def test_log_probs_a_feature_pass_kept_are_read_by_a_later_session_of_the_same_model(tiny_trainer, tmp_path):
    """The worker's idle work pools in a session of its own: the run's reference and run-start passes
    read the log-probs it kept, and only under the model that computed them."""
    samples = preference_samples()[:6]
    encoded = [encode_sample(tiny_trainer.tokenizer, s, 96) for s in samples]
    feature_memo.forget(tiny_trainer)
    with tiny_trainer.adapter(None, LEARN, trainable=True, precision="fp32"):
        _, batches = tiny_trainer.batches(encoded, 4096)
        assert [tiny_trainer._recall(b) for b in batches] == [None] * len(batches)
        fresh = [tiny_trainer.logprobs(b) for b in batches]
        tiny_trainer.save(tmp_path / "v1")
    with tiny_trainer.adapter(None, LEARN, precision="fp32"):  # the idle work's session: no training
        reward_features.remember(tiny_trainer, samples, 96, feature_memo.rows_for(tiny_trainer, None, "fp32"))
    with tiny_trainer.adapter(None, LEARN, trainable=True, precision="fp32"):
        for batch, want in zip(batches, fresh, strict=True):
            got = tiny_trainer._recall(batch)
            assert got is not None
            mask = batch["response_mask"]
            assert torch.allclose(got[mask], want[mask], atol=1e-5) and bool(got[mask].ne(0).all())
    with tiny_trainer.adapter(tmp_path / "v1", None, precision="fp32"):  # another model: nothing of the base's
        assert all(tiny_trainer._recall(b) is None for b in batches)
    # bf16: a row's values depend on its batch, so only the base's are kept. A fresh LoRA's session
    # keeps them and reads them (the micro-batches its first step trains take theirs from that step's
    # own pass, never from here); one continuing an adapter reads them as its KL anchor.
    base = feature_memo.memo_for(tiny_trainer, None, "bf16")
    with tiny_trainer.adapter(None, LEARN, trainable=True, precision="bf16"):
        base_bf16 = [tiny_trainer._logprobs(b) for b in batches]  # in the run's own batches
        assert all(tiny_trainer._recall(b) is None for b in batches)
        assert reward_features.remember(tiny_trainer, samples, 96, base.pooled) == 6  # the base served
        assert tiny_trainer._known() is base.logprobs and len(base.logprobs) == 6
        for batch, want in zip(batches, base_bf16, strict=True):
            # Read from the feature pass's batches, its output head in fp32 as the run's own passes run it
            # (under the feature pass's autocast it rounded the logits to bf16: hundredths of a nat).
            got = tiny_trainer.logprobs(batch)
            mask = batch["response_mask"]
            assert tiny_trainer._recall(batch) is not None and torch.allclose(got[mask], want[mask], atol=1e-4)
    base.logprobs.clear()
    with tiny_trainer.adapter(tmp_path / "v1", None, precision="bf16"):  # the idle work under v1, in bf16
        assert tiny_trainer._known() is None  # v1's own: never kept in bf16
        with tiny_trainer.reference():
            # The features are there from the session above; the log-probs are not: run again.
            assert reward_features.remember(tiny_trainer, samples, 96, base.pooled) == 0
            assert reward_features.remember(tiny_trainer, samples, 96, base.pooled, logprobs=base.logprobs) == 6
            assert reward_features.remember(tiny_trainer, samples, 96, base.pooled, logprobs=base.logprobs) == 0
    with tiny_trainer.adapter(tmp_path / "v1", LEARN, trainable=True, precision="bf16"):  # a run continuing v1
        assert all(tiny_trainer._recall(b) is None for b in batches)  # v1's own: computed in the run
        with tiny_trainer.reference():
            for batch, want in zip(batches, base_bf16, strict=True):
                got = tiny_trainer._recall(batch)
                mask = batch["response_mask"]
                assert got is not None and torch.allclose(got[mask], want[mask], atol=1e-4)
    feature_memo.forget(tiny_trainer)


def test_the_idle_work_lets_go_of_the_trainer_when_a_run_wants_it():
    started, saw_stop = threading.Event(), []

    def work(slug: str, stop) -> int:
        started.set()
        while not stop():
            time.sleep(0.01)
        saw_stop.append(slug)
        return 0

    idle = IdleWorker(work)
    idle.start()
    try:
        idle.due("m")
        assert started.wait(10)
        with LEASE.idle() as mine:
            assert not mine  # the idle work has it
        t0 = time.monotonic()
        with LEASE.run():
            assert saw_stop == ["m"] and time.monotonic() - t0 < 5
            with LEASE.idle() as mine:
                assert not mine  # a run has it: idle work waits for the next chance
        assert idle.settled(10)
        with LEASE.idle() as mine:
            assert mine
    finally:
        idle.stop()
    assert not idle._thread.is_alive()


def test_a_run_waiting_behind_another_keeps_the_idle_work_out():
    lease = idle_work.TrainerLease()
    second_in = threading.Event()

    def second() -> None:
        with lease.run():
            second_in.set()

    with lease.run():
        assert not lease.wanted()  # this run has it; nobody waits
        t = threading.Thread(target=second)
        t.start()
        deadline = time.monotonic() + 5
        while not lease.wanted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lease.wanted() and not second_in.is_set()
    t.join(5)
    assert second_in.is_set() and not lease.wanted()
    with lease.idle() as mine:
        assert mine


def test_the_trainer_falling_idle_gives_malloc_s_kept_memory_back_and_a_handover_does_not(monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(idle_work.allocator, "release", lambda: released.append("released") or True)
    lease = idle_work.TrainerLease()
    second_in = threading.Event()

    def second() -> None:
        with lease.run():
            second_in.set()
            assert released == []  # handed over from the first run, which let go with this one waiting

    with lease.run():
        t = threading.Thread(target=second)
        t.start()
        deadline = time.monotonic() + 5
        while not lease.wanted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lease.wanted()
    t.join(5)
    assert second_in.is_set() and released == ["released"]  # the second let go with nobody waiting
    with lease.idle() as mine:
        assert mine and released == ["released"]
    assert released == ["released"] * 2  # the idle work's pass ended: idle again
    with lease.run(), lease.idle() as mine:
        assert not mine
    assert released == ["released"] * 3  # a pass that never had the trainer gives nothing back; the run did


def test_the_idle_work_survives_a_failing_pass():
    calls: list[str] = []

    def work(slug: str, stop) -> int:
        calls.append(slug)
        if slug == "bad":
            raise RuntimeError("no such model")
        return 1

    idle = IdleWorker(work)
    idle.start()
    try:
        idle.due("bad")
        idle.due("good")
        assert idle.settled(10) and calls == ["bad", "good"]
    finally:
        idle.stop()


def test_a_run_reads_the_features_its_worker_pooled_after_the_run_before(gated_home, monkeypatch):  # noqa: F811
    monkeypatch.setattr(idle_work, "IDLE_POLL", None)  # no look for new ratings in between: run 2's own unpooled
    cfg = load_config()
    cfg.train.explore, cfg.train.steps = 0, 2  # only the reward model's reading of the history matters here
    cfg.save()
    slug = model_slug(str(cfg.model))
    with opened_queue() as (cfg, handle):
        assert warm_features(slug, lambda: False) == 0  # no earlier ratings yet: nothing to do
        trainer = get_trainer(cfg)
        feature_memo.forget(trainer)
        # Which threads the runs and the idle passes compute on (rlfleet.shared.compute_thread).
        computed_on: list[tuple[str, str]] = []
        run, warm = trainer.run, idle_work.warm_features
        monkeypatch.setattr(trainer, "run", lambda *a, **k: computed_on.append(
            ("run", threading.current_thread().name)) or run(*a, **k))
        monkeypatch.setattr(idle_work, "warm_features", lambda *a: computed_on.append(
            ("idle", threading.current_thread().name)) or warm(*a))
        idle = idle_work.start_idle_work(cfg, None)
        assert idle is not None
        try:
            _prefer(cfg, handle, TOPICS[:6], GOOD, BAD)
            _work_train_queue(handle)  # run 1: v0001 serves; its end makes the next run's features due
            st = status()
            assert st["adapter"]["current"] == "v0001", st["training"]
            assert idle.settled(60)
            assert warm_features(slug, lambda: False) == 0  # all 8 consumed ratings pooled already
            _prefer(cfg, handle, TOPICS[6:10], GOOD, BAD)
            _work_train_queue(handle)  # run 2, from v0001
        finally:
            idle_work.stop_idle_work()
        runs = {v["version"]: v["metrics"] for v in status()["adapter"]["versions"]}
        assert runs["v0001"]["reward_model_known"] == 0
        # Run 2's reward model read the 8 ratings run 1 consumed and the 4 its gate held out (pending since)
        # without a pass of its own over them.
        assert runs["v0002"]["reward_model_known"] == 12
        assert runs["v0002"]["reward_model_auc"] is not None
        # Both runs and the idle work between them on one thread: not the worker's, not the idle work's.
        assert [what for what, _ in computed_on].count("run") == 2 and ("idle", "rlfleet-compute") in computed_on
        assert {name for _, name in computed_on} == {"rlfleet-compute"}, computed_on
        feature_memo.forget(trainer)


def test_without_idle_features_the_worker_does_none(gated_home):  # noqa: F811 (the fixture)
    cfg = load_config()
    cfg.train.idle_features, cfg.train.explore, cfg.train.steps = False, 0, 2
    cfg.save()
    assert idle_work.start_idle_work(cfg, None) is None
    with opened_queue() as (cfg, handle):
        _prefer(cfg, handle, TOPICS[:6], GOOD, BAD)
        _work_train_queue(handle)
        assert status()["adapter"]["current"] == "v0001"
        assert warm_features(model_slug(str(cfg.model)), lambda: False) == 0


@pytest.fixture(autouse=True)
def _no_idle_worker_left():
    yield
    idle_work.stop_idle_work()


def test_the_idle_work_looks_again_at_the_lineages_it_worked_on():
    calls: list[str] = []
    idle = IdleWorker(lambda slug, stop: calls.append(slug) or 0, poll=0.05)
    idle.start()
    try:
        idle.due("m")
        deadline = time.monotonic() + 10
        while calls.count("m") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert calls.count("m") >= 3 and set(calls) == {"m"}  # only what it was told of
    finally:
        idle.stop()
    assert not idle._thread.is_alive()


def test_a_run_reads_what_its_worker_did_ahead_while_the_ratings_came_in(gated_home):  # noqa: F811 (the fixture)
    """The pending ratings' features, the answers the run explores with theirs, and, for a run continuing
    a version, the base's log-probs of both: done by the worker before the threshold-th rating, read by
    the run; done once (a second look with nothing new does nothing)."""
    cfg = load_config()
    cfg.train.steps, cfg.train.explore, cfg.train.explore_prompts, cfg.train.explore_max_new_tokens = 2, 2, 4, 16
    cfg.train.reward_model_min_auc = 0.5  # the tiny model's reward model need not be good for this
    cfg.save()
    slug = model_slug(str(cfg.model))
    with opened_queue() as (cfg, handle):
        trainer = get_trainer(cfg)
        feature_memo.forget(trainer)
        _prefer(cfg, handle, TOPICS[:5], GOOD, BAD)  # 10 of the 12 ratings that start a run
        assert warm_features(slug, lambda: False) > 0
        assert warm_features(slug, lambda: False) == 0  # nothing new since
        memo = feature_memo.memo_for(trainer, None, "fp32")
        assert len(memo.drawn) == 5  # every pending prompt: the run's newest training ones among them
        _prefer(cfg, handle, TOPICS[5:6], GOOD, BAD)  # the last two: the run is queued
        _work_train_queue(handle)
        v1 = {v["version"]: v["metrics"] for v in status()["adapter"]["versions"]}["v0001"]
        # Held out: the 4 newest (topics 4 and 5); trained: topics 0-3, whose 8 answers and 4 prompts'
        # explored answers the worker had pooled and drawn.
        assert v1["explored_known"] == 4 and v1["explored"] >= 8, v1
        assert v1["reward_model_known"] == 8
        assert status()["adapter"]["current"] == "v0001"

        _prefer(cfg, handle, TOPICS[6:8], GOOD, BAD)
        assert warm_features(slug, lambda: False) > 0
        # A run continuing v0001 reads the base's log-probs in its reference pass: kept for the pending
        # answers and the explored ones, beside v0001's own.
        base = feature_memo.memo_for(trainer, None, "fp32")
        served = feature_memo.memo_for(trainer, cfg.adapters_root / slug / "v0001", "fp32")
        assert len(served.drawn) == 4  # the 4 held-out ratings' prompts and the 2 new ones: 4 topics
        tcfg = for_trainer(cfg.train, trainer)
        rows = [feature_memo.row_key(encode_sample(trainer.tokenizer, s, tcfg.max_tokens))
                for (prompt, *_), answers in served.drawn.items()
                for s in exploration.as_samples(trainer, [json.loads(prompt)] * len(answers), answers, tcfg)[0]]
        assert rows and all(k in served.logprobs and k in base.logprobs for k in rows)
        rated = [k for k in served.logprobs if k not in rows]  # the pending ratings' answers
        assert len(rated) >= 8 and all(k in base.logprobs for k in rated)
    feature_memo.forget(trainer)


def test_the_gates_base_answers_are_drawn_ahead_for_the_held_out_prompts_and_those_the_next_rating_may_add():
    def rated(i, prompt, reward, fixed=None):
        return TrainSample(rating_id=i, prompt=[{"role": "user", "content": prompt}], response="r", reward=reward,
                           fixed_advantage=fixed)

    train = [rated(1, "a", 1.0), rated(2, "b", -1.0), rated(3, "c", 1.0), rated(4, "d", -1.0),
             rated(9, "z", -1.0, fixed=0.0)]  # a retraction: never held out
    held = [rated(5, "e", 1.0), rated(6, "f", -1.0), rated(7, "e", 1.0)]
    captured = [[{"role": "user", "content": "new"}], [{"role": "user", "content": "older"}]]
    got = {p[0]["content"]: n for p, n in idle_work.held_prompts(train, held, captured, 32)}
    # 32 answers over 3 held-out answers: 11 a prompt at most, a prompt held out twice twice that; the
    # newest training rating of each class and the newest unrated prompt as many as a held-out one.
    assert got == {"e": 22, "f": 11, "c": 11, "d": 11, "new": 11}
    assert idle_work.held_prompts(train, [], captured, 32) == []
    assert idle_work.held_prompts(train, held, captured, 0) == []
