"""Between runs the training worker pools the earlier ratings' answers under the served version, and
the next run's reward model reads them instead of running the model over them again
(worker/idle_work.py, worker/training/feature_memo.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_gate_runs import BAD, GOOD, TOPICS, _prefer, gated_home  # noqa: F401 (a fixture)
from test_spine import _work_train_queue, opened_queue, status
from test_trainer import LEARN, preference_samples

from rlfleet.shared.config import load_config
from rlfleet.shared.models import model_slug
from rlfleet.worker import idle_work
from rlfleet.worker.idle_work import LEASE, IdleWorker, warm_features
from rlfleet.worker.trainer_cache import get_trainer
from rlfleet.worker.training import feature_memo, reward_features


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
    # The worker's idle work pools in a session that does not train: it keeps no log-probs beside the
    # hidden states (a run's session keeps them for its reference and behaviour passes).
    for trainable in (True, False):
        with tiny_trainer.adapter(None, LEARN, trainable=trainable, precision="fp32"):
            reward_features.remember(tiny_trainer, samples[:4], 96, {})
            assert bool(tiny_trainer._known) == trainable
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


def test_a_run_reads_the_features_its_worker_pooled_after_the_run_before(gated_home):  # noqa: F811 (the fixture)
    cfg = load_config()
    cfg.train.explore, cfg.train.steps = 0, 2  # only the reward model's reading of the history matters here
    cfg.save()
    slug = model_slug(str(cfg.model))
    with opened_queue() as (cfg, handle):
        assert warm_features(slug, lambda: False) == 0  # no earlier ratings yet: nothing to do
        trainer = get_trainer(cfg)
        feature_memo.forget(trainer)
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
        # Run 2's reward model read the 8 ratings run 1 consumed without a pass of its own over them.
        assert runs["v0002"]["reward_model_known"] == 8
        assert runs["v0002"]["reward_model_auc"] is not None
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
