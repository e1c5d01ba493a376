"""Nobody restarts anything: the workers `rlfleet up` and `rlfleet chat` start are supervised. SIGKILL
the training worker mid-run and the events worker mid-stream: both come back by themselves, the run
completes into a served adapter, and every rating sent meanwhile is stored. A child that dies right
after every start is given up on, not restarted forever."""

from __future__ import annotations

import time

from chaosrig import kill9, stored_counts

from rlfleet.cli.fleet import BackgroundWorkers, RestartPolicy
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import enqueue_event, open_queue, progress_key
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store

THRESHOLD, STEPS = 4, 12


def wait(what: str, cond, timeout: float, workers: BackgroundWorkers):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            logs = {n: workers.log_path(n).read_text()[-1500:] for n in workers.children}
            raise AssertionError(f"{what}: not within {timeout} s; {workers.state()}\n{logs}")
        time.sleep(0.05)


def test_killed_workers_come_back_by_themselves_and_the_run_completes(chaos_home, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(model=str(tiny_model_dir))
    cfg.train.threshold, cfg.train.steps, cfg.train.max_tokens = THRESHOLD, STEPS, 96
    cfg.train.gate = False  # the point is the restart, not the verdict
    cfg.save()
    slug = model_slug(cfg.model)
    store, handle = Store(cfg.db_url), open_queue(cfg)
    registry = AdapterRegistry(cfg.adapters_root, slug)
    for i in range(3 * THRESHOLD):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"question {i}")],
                                    response=f"answer number {i}", model="external"))
    sent: list[str] = []  # event ids acknowledged to the user

    def rate(n: int) -> None:
        for _ in range(n):
            ev = Rating(target=f"c{len(sent)}", value=1 if len(sent) % 2 else -1)
            enqueue_event(handle, ev)
            sent.append(ev.event_id)

    workers = BackgroundWorkers(cfg)
    workers.start()
    try:
        rate(THRESHOLD)
        wait("the run reaches its optimizer steps",
             lambda: int(handle.redis.hget(progress_key(slug), "step") or -1) >= 1, 90, workers)
        killed = workers.children["train"].proc.pid
        kill9(workers.children["train"].proc)
        assert registry.current() is None  # the killed run served nothing
        wait("the training worker is started again", lambda: workers.children["train"].restarts == 1, 10, workers)
        assert workers.children["train"].proc.pid != killed

        kill9(workers.children["events"].proc)
        rate(2)  # sent while no events worker runs: they wait on the queue
        wait("the events worker is started again", lambda: workers.children["events"].restarts == 1, 10, workers)

        # Nobody asks for training again: the restarted worker's recovery requeues the interrupted run.
        wait("a served adapter", registry.current, 120, workers)
        wait("every rating stored", lambda: len(stored_counts(cfg.db_url)) == len(sent), 30, workers)
        assert stored_counts(cfg.db_url) == dict.fromkeys(sent, 1)
        assert workers.alive() == {"events": True, "train": True}
        assert workers.state() == {"events": "restarted 1x", "train": "restarted 1x"}
    finally:
        workers.stop()
        handle.close()
    assert not workers.children


def test_a_child_that_dies_at_every_start_is_given_up_on(home, monkeypatch):
    cfg = load_config()
    policy = RestartPolicy(healthy_after=30, first_delay=0.05, max_delay=0.1, give_up_after=3)
    workers = BackgroundWorkers(cfg, which=(), bots=("nosuch",), policy=policy)  # `rlfleet bot nosuch` exits 2
    workers.start(supervise=False)
    try:
        child = workers.children["bot-nosuch"]
        deadline = time.monotonic() + 60
        while not child.gave_up and time.monotonic() < deadline:
            workers.supervise()
            time.sleep(0.05)
        assert child.gave_up and child.restarts == 2, workers.state()
        assert workers.state() == {"bot-nosuch": "stopped after 3 quick exits (code 2), not restarted"}
        restarts = child.restarts
        workers.supervise(now=time.monotonic() + 3600)
        assert child.restarts == restarts  # given up stays given up
        assert "unknown platform 'nosuch'" in workers.log_path("bot-nosuch").read_text()
    finally:
        workers.stop()


def test_restart_policy_waits_longer_after_each_quick_death_then_gives_up():
    policy = RestartPolicy(first_delay=1, max_delay=5, give_up_after=5)
    assert [policy.delay(n) for n in range(6)] == [0, 1, 2, 4, 5, None]
