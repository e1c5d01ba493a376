"""The whole loop on a tiny model: capture -> Redis/RQ -> store -> trigger -> MIS-PO LoRA run ->
versioned adapter -> CURRENT -> rollback, undo of trained ratings, failure handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from rq import Queue, SimpleWorker
from typer.testing import CliRunner

from rlfleet.cli import dispatch
from rlfleet.cli.app import app
from rlfleet.shared import allocator
from rlfleet.shared.config import Config, load_config
from rlfleet.shared.events import Capture, Rating, Undo
from rlfleet.shared.queue import TRAIN_QUEUE, QueueHandle, open_queue
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store

runner = CliRunner()


def rl(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def status():
    res = rl("status", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _use_tiny_model(model_dir, monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(model_dir))
    monkeypatch.setenv("RLFLEET_THRESHOLD", "4")
    cfg = load_config()
    # a few fast steps: these tests check the plumbing; learning is shown in test_trainer
    cfg.train.steps = 2
    cfg.train.max_tokens = 96
    cfg.save()
    return cfg


@pytest.fixture
def tiny_home(queued_home, tiny_model_dir, monkeypatch):
    _use_tiny_model(tiny_model_dir, monkeypatch)
    return queued_home


def _rate_some(cfg, handle, n, value_of=lambda i: 1 if i % 2 == 0 else -1):
    results = []
    for i in range(n):
        cap = Capture(prompt=[{"role": "user", "content": f"question {i}"}], response=f"answer number {i}",
                      model="external", conversation="t")
        assert dispatch(handle, cfg, cap)["ok"]
        results.append(dispatch(handle, cfg, Rating(value=value_of(i), target=cap.capture_id)))
    return results


def _work_train_queue(handle):
    SimpleWorker([Queue(TRAIN_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)


@contextmanager
def opened_queue() -> Iterator[tuple[Config, QueueHandle]]:
    """The test home's configuration and a queue handle on it, closed when the block ends."""
    cfg = load_config()
    handle = open_queue(cfg)
    try:
        yield cfg, handle
    finally:
        handle.close()


def _first_version(cfg, handle) -> None:
    """Rate a threshold's worth (4) and run the training they trigger: v0001 serves."""
    _rate_some(cfg, handle, 4)
    _work_train_queue(handle)
    assert status()["adapter"]["current"] == "v0001"


def test_threshold_triggers_one_run_that_promotes_a_loadable_version(tiny_home):
    with opened_queue() as (cfg, handle):
        results = _rate_some(cfg, handle, 3)
        assert all("training" not in r or r["training"] is None for r in results)
        assert status()["ratings"]["pending"] == 3
        results = _rate_some(cfg, handle, 3)
        assert results[0]["training"].startswith("training run")  # the 4th rating triggers
        assert "already queued" in results[1]["training"]  # never two runs for one model
        assert handle.train.count == 1
        assert status()["training"]["state"] == "queued"

        _work_train_queue(handle)
        st = status()
        assert st["training"]["state"] == "idle", st["training"]
        assert st["adapter"]["current"] == "v0001"
        (v,) = st["adapter"]["versions"]
        assert v["status"] == "active" and v["metrics"]["ratings_used"] == 6
        for key in ("mean_advantage", "loss", "mean_kl", "accepted_token_frac", "accepted_seq_frac", "tokens_per_s"):
            assert key in v["metrics"]
        assert st["ratings"]["pending"] == 0 and st["ema_seeded"]

        reg = AdapterRegistry(cfg.adapters_root, st["model_slug"])
        meta = reg.meta("v0001")
        assert meta["parent"] is None and len(meta["rating_ids"]) == 6
        from peft import PeftModel

        from rlfleet.shared.models import load_model, resolve_model

        PeftModel.from_pretrained(load_model(resolve_model(cfg.model)), str(reg.path("v0001")))

        # second run continues the lineage
        _rate_some(cfg, handle, 4)
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] == "v0002"
        assert reg.meta("v0002")["parent"] == "v0001"
        assert [v["status"] for v in st["adapter"]["versions"]] == ["candidate", "active"]

        # rollback is instant and goes to the parent; then to the base
        assert rl("rollback").exit_code == 0
        assert reg.current() == "v0001"
        assert rl("rollback", "base").exit_code == 0
        assert reg.current() is None
        assert rl("rollback", "v0002").exit_code == 0
        assert reg.current() == "v0002"
        # a version as people type it
        assert rl("rollback", "1").exit_code == 0
        assert reg.current() == "v0001"
        res = rl("rollback", "v1")  # where it is already
        assert res.exit_code == 0 and "already serving v0001" in res.output and reg.current() == "v0001"
        assert rl("promote", "v2").exit_code == 0
        assert reg.current() == "v0002"


def test_undo_of_a_trained_rating_is_retracted_by_the_next_run(tiny_home):
    with opened_queue() as (cfg, handle):
        _first_version(cfg, handle)
        assert dispatch(handle, cfg, Undo())["ok"]
        store = Store(cfg.db_url)
        slug = status()["model_slug"]
        pending = store.pending_ratings(slug, 10)
        assert len(pending) == 1 and pending[0][0].state == "undone"
        res = rl("train", "--wait", "--json")
        assert res.exit_code == 0, res.output
        # No worker was running: the run trained in a training worker the command started, on the malloc
        # a training worker preloads (not in this test's process, which runs on the system's).
        assert json.loads(res.output)["metrics"]["allocator"] == allocator.kind(allocator.library())
        assert (cfg.home / "logs" / "worker-train.log").is_file()
        meta = AdapterRegistry(cfg.adapters_root, slug).meta("v0002")
        assert meta["retracted_rating_ids"] == [pending[0][0].id] and meta["rating_ids"] == []
        assert store.pending_ratings(slug, 10) == []


def test_train_wait_says_where_to_look_when_its_training_worker_dies_and_leaves_the_run_queued(
        tiny_home, monkeypatch):
    from rlfleet.cli import fleet

    spawn = fleet.BackgroundWorkers._spawn
    # the worker it starts exits at once (an unknown queue: exit code 2), before it takes the run
    monkeypatch.setattr(fleet.BackgroundWorkers, "_spawn",
                        lambda self, name, argv: spawn(self, name, ["rlfleet.worker", "--queue", "nosuch"]))
    with opened_queue() as (cfg, handle):
        _rate_some(cfg, handle, 2)
        res = rl("train", "--wait", "--json")
        said = json.loads(res.output)
        assert res.exit_code != 0 and not said["ok"]
        log = cfg.home / "logs" / "worker-train.log"
        assert "exited with code 2" in said["message"] and str(log) in said["message"] and log.is_file()
        assert status()["training"]["state"] == "queued" and handle.train.count == 1  # for the next worker
        _work_train_queue(handle)
        assert status()["adapter"]["current"] == "v0001"


def test_train_wait_finishes_the_run_in_hand_on_a_first_ctrl_c_and_stops_at_a_second(tiny_home):
    cfg = load_config()
    cfg.train.steps = 60  # a run long enough to be interrupted in (several seconds on the tiny model)
    cfg.save()
    with opened_queue() as (cfg, handle):
        _rate_some(cfg, handle, 2)
    store = Store(cfg.db_url)
    slug = status()["model_slug"]

    def interrupted(times: int) -> tuple[subprocess.Popen, str, str]:
        proc = subprocess.Popen([sys.executable, "-c", "from rlfleet.cli import main; main()", "train", "--wait"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while (run := store.latest_run(slug)) is None or run.state != "running" or run.id in seen:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"no run started: {proc.communicate(timeout=30)}")
            time.sleep(0.1)
        seen.add(run.id)
        for _ in range(times):
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        out, said = proc.communicate(timeout=600)
        return proc, out, said

    seen: set[int] = set()
    proc, out, said = interrupted(1)  # the run ends as it would have, then the command
    assert "finishing the run in hand" in said and proc.returncode == 0 and "v0001 is live" in out, (out, said)
    with opened_queue() as (cfg, handle):
        _rate_some(cfg, handle, 2)
    proc, out, said = interrupted(2)  # stopped now: the run is let go, the served version stays
    assert proc.returncode != 0 and "interrupted" in out + said, (out, said)
    assert status()["adapter"]["current"] == "v0001"
    assert store.get_run(max(seen)).state == "failed"


def test_a_failed_run_keeps_current_and_reports_the_error(tiny_home, monkeypatch):
    with opened_queue() as (cfg, handle):
        _first_version(cfg, handle)
        _rate_some(cfg, handle, 3)

        import rlfleet.worker.training.torch_backend as trainer_mod

        def boom(self, *a, **k):
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(trainer_mod.Trainer, "run", boom)
        _rate_some(cfg, handle, 1)
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] == "v0001"
        assert st["training"]["state"] == "failed" and "out of memory" in st["training"]["error"]
        assert st["ratings"]["pending"] == 4  # nothing consumed
        reg = AdapterRegistry(cfg.adapters_root, st["model_slug"])
        assert reg.versions() == ["v0001"]
        assert not [p for p in reg.dir.iterdir() if p.name.startswith(".staging")]


def test_an_asymmetric_run_of_only_dislikes_trains_nothing_and_says_why(tiny_home):
    """Under the asymmetric rule a run whose ratings are all 👎 has advantage 0 everywhere: it commits
    no version (an identical one would be promoted and announced as new), keeps its ratings pending,
    says why in status and in the chat, and the next run waits for half a threshold of new ratings."""
    from rlfleet.bots.training_news import TrainingNews

    cfg = load_config()
    cfg.train.advantage, cfg.train.gate = "asymmetric", False
    cfg.save()
    with opened_queue() as (cfg, handle):
        store, slug = Store(cfg.db_url), status()["model_slug"]
        news = TrainingNews(store, None, slug, cfg.train.threshold)
        _rate_some(cfg, handle, 4, value_of=lambda i: -1)
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] is None and st["adapter"]["versions"] == []
        assert st["ratings"]["pending"] == 4
        assert st["training"]["state"] == "idle" and "none of them liked" in st["training"]["error"]
        assert not list(AdapterRegistry(cfg.adapters_root, slug).dir.glob(".staging*"))
        (said,) = news.poll().ended
        assert said.startswith("· training run 1 trained nothing: nothing to learn from these 4 ratings yet")
        assert said.endswith("ratings stay pending, next run after 2 more")

        results = _rate_some(cfg, handle, 2, value_of=lambda i: 1)  # a liked answer: now there is
        assert results[0]["training"] is None and results[1]["training"].startswith("training run 2")
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] == "v0001" and st["ratings"]["pending"] == 0


def test_a_runs_reward_model_learns_from_the_users_earlier_ratings_too(tiny_home):
    with opened_queue() as (cfg, handle):
        _first_version(cfg, handle)  # 2 liked and 2 disliked answers, trained on by v0001
        _rate_some(cfg, handle, 4, value_of=lambda i: -1)
        _work_train_queue(handle)
        st = status()
        m = st["adapter"]["versions"][-1]["metrics"]
        assert st["adapter"]["versions"][-1]["version"] == "v0002"
        # This run's own ratings are all 👎 (no reward model from them alone); v0001's two liked count.
        assert m["reward_model_auc"] is not None, m["reward_model_reason"]


def test_a_run_that_lost_redis_is_interrupted_and_queued_again_on_recovery(tiny_home, monkeypatch):
    """Redis gone in the middle of a run: the run is "interrupted" (not failed, which would wait for
    new ratings), and the worker's recovery, once Redis answers, queues it again by itself."""
    import redis as redis_mod

    from rlfleet.worker.runner import recover

    with opened_queue() as (cfg, handle):
        import rlfleet.worker.training.torch_backend as trainer_mod

        real_run = trainer_mod.Trainer.run

        def lost(self, *a, **k):
            raise redis_mod.ConnectionError("Connection closed by server.")

        monkeypatch.setattr(trainer_mod.Trainer, "run", lost)
        _rate_some(cfg, handle, 4)
        _work_train_queue(handle)  # the run's job raises, as it would with Redis gone
        st = status()
        assert st["training"]["state"] == "failed" and st["training"]["error"].startswith("interrupted: lost Redis")
        assert st["adapter"]["current"] is None and st["ratings"]["pending"] == 4
        assert handle.train.count == 0

        monkeypatch.setattr(trainer_mod.Trainer, "run", real_run)
        notes = recover(cfg, handle)  # what the worker runs when Redis answers again
        assert any("queued" in n for n in notes), notes  # no new rating was needed
        _work_train_queue(handle)
        assert status()["adapter"]["current"] == "v0001"


def test_a_run_interrupted_three_times_in_a_row_waits_for_new_ratings(tiny_home, monkeypatch):
    """A run that takes its worker down every time (the OOM killer, say) is retried at once twice, then
    treated like a failure: no retry loop, a reason in status, and new ratings or `train` go on."""
    import redis as redis_mod

    import rlfleet.worker.training.torch_backend as trainer_mod
    from rlfleet.shared.runs import INTERRUPTED_IN_A_ROW
    from rlfleet.worker.runner import recover

    with opened_queue() as (cfg, handle):
        def lost(self, *a, **k):
            raise redis_mod.ConnectionError("Connection closed by server.")

        monkeypatch.setattr(trainer_mod.Trainer, "run", lost)
        _rate_some(cfg, handle, 4)
        for attempt in range(1, INTERRUPTED_IN_A_ROW + 1):
            _work_train_queue(handle)
            notes = recover(cfg, handle)
            retried = any("queued" in n for n in notes)
            assert retried == (attempt < INTERRUPTED_IN_A_ROW), (attempt, notes)
        assert handle.train.count == 0
        st = status()
        assert st["ratings"]["pending"] == 4
        assert "3 runs in a row: not retried" in st["training"]["error"], st["training"]

        _rate_some(cfg, handle, 1)  # one new rating is not half a threshold (2): still waiting
        assert handle.train.count == 0
        results = _rate_some(cfg, handle, 1)
        assert results[0]["training"].startswith("training run")


def test_default_path_embedded_redis_and_background_workers(home, tiny_model_dir, monkeypatch):
    """No REDIS_URL: the embedded server, worker subprocesses, training in the background; the training
    worker at `train.nice` (it gives way to what answers people), the events worker as it was started."""
    cfg = _use_tiny_model(tiny_model_dir, monkeypatch)
    cfg.train.nice = 7
    cfg.save()
    from rlfleet.cli.fleet import BackgroundWorkers

    handle = open_queue(cfg)
    workers = BackgroundWorkers(cfg)
    workers.start()
    try:
        assert handle.embedded is not None
        _rate_some(cfg, handle, 4)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if AdapterRegistry(cfg.adapters_root, status()["model_slug"]).current() == "v0001":
                break
            assert all(workers.alive().values()), workers.log_path("train").read_text()[-2000:]
            time.sleep(0.5)
        st = status()
        assert st["adapter"]["current"] == "v0001", st
        assert st["workers"] == 2
        ours = os.getpriority(os.PRIO_PROCESS, 0)

        def niceness(pid: int) -> set[int]:  # of each of its threads: a Linux thread has its own
            return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}

        got = {name: niceness(proc.pid) for name, proc in workers.procs.items()}
        assert got == {"events": {ours}, "train": {max(ours, 7)}}, got
    finally:
        workers.stop()
        handle.close()
    assert not (home / "redis" / "redis.sock").exists() or not _answers(home)


def test_stopping_the_workers_mid_run_is_quiet_and_the_run_goes_on_at_the_next_start(home, tiny_model_dir,
                                                                                     monkeypatch):
    """What /quit, Ctrl-C or the end of `up` do during a training run: the training worker stops within
    the stop's grace, says so in one line of its log (no traceback), and the next start runs the run
    again by itself. (That a user's stops never count toward the three-interrupted-runs rule is the
    store's question, shown in test_trigger_rule without starting workers again and again.)"""
    from rlfleet.cli.fleet import BackgroundWorkers
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import progress_key
    cfg = _use_tiny_model(tiny_model_dir, monkeypatch)
    cfg.train.steps = 10_000  # long enough to be stopped in the middle
    cfg.save()
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    handle = open_queue(cfg)
    workers = BackgroundWorkers(cfg)

    def wait(what, cond, timeout=180):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}\n{workers.log_path('train').read_text()[-3000:]}"
            assert all(workers.alive().values()), workers.log_path("train").read_text()[-3000:]
            time.sleep(0.2)

    try:
        workers.start()
        _rate_some(cfg, handle, 4)
        wait("no run got to its optimizer steps",
             lambda: int(handle.redis.hget(progress_key(slug), "step") or 0) >= 1
             and handle.redis.hget(progress_key(slug), "phase") == b"training")
        run_id = store.latest_run(slug).id
        log_start = workers.log_path("train").stat().st_size
        workers.stop()
        log = workers.log_path("train").read_text()[log_start:]
        assert "Traceback" not in log and f"stopped during training run {run_id}" in log, log
        run = store.get_run(run_id)
        assert run.state == "failed" and run.error.startswith("interrupted: stopped on request"), run.error
        cfg.train.steps = 2
        cfg.save()
        workers.start()
        wait("the stopped run did not run again", lambda: AdapterRegistry(cfg.adapters_root, slug).current())
        assert store.latest_run(slug).id > run_id  # ran again as a new run
    finally:
        workers.stop()
        handle.close()


def _answers(home) -> bool:
    from rlfleet.shared.embedded_redis import EmbeddedRedis

    return EmbeddedRedis.running(home)
