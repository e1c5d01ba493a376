"""Crash and restart: SIGKILL the training worker at random moments of a run (loading the model,
computing reference log-probs, in the optimizer steps, saving, committing) while ratings keep coming.
After every kill: CURRENT never names a half-written adapter, and once the worker is started again a
run completes and a new version appears without anyone triggering it; at the end every acknowledged
rating is stored exactly once and no training lock is left held. Bounded in time; prints its counts."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from functools import partial

from chaosrig import adapter_problem, current_problem, env_for, kill9, stop, stored_counts, tail, worker
from rq.registry import StartedJobRegistry

from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import TRAIN_QUEUE, enqueue_event, open_queue, progress_key, train_lock_key
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.schema import TrainRun
from rlfleet.shared.store import Store

KILLS, THRESHOLD, STEPS = 4, 6, 24
RESUME_S = 40  # a restarted worker imports torch and loads the model before it trains (about 8 s here)
PATIENCE = 4  # a wait that sees training move on extends, up to this many times its bound: a loaded runner is slow


class CurrentWatch(threading.Thread):
    """Reads CURRENT off the disk every few milliseconds for the whole test and loads whatever it names."""

    def __init__(self, adapter_dir) -> None:
        super().__init__(daemon=True)
        self.dir, self.problems, self.seen = adapter_dir, [], set()
        self.halt = threading.Event()

    def run(self) -> None:
        last = None
        while not self.halt.is_set():
            try:
                name = (self.dir / "CURRENT").read_text(encoding="utf-8").strip()
            except OSError:
                name = None
            if name != last:  # a change: check the folder it names (once per change: loading is not free)
                problem = current_problem(self.dir)
                if problem:
                    self.problems.append(problem)
                if name:
                    self.seen.add(name)
                last = name
            time.sleep(0.005)


def test_killed_training_worker_resumes_and_never_serves_a_partial_adapter(chaos_home, tiny_model_dir, tmp_path):
    rng = random.Random(20261124)
    cfg = load_config(model=str(tiny_model_dir))
    cfg.train.threshold = THRESHOLD
    cfg.train.steps = STEPS
    cfg.train.max_tokens = 96
    cfg.train.gate = False  # every finished run is promoted, so CURRENT moves and each commit is a target
    cfg.save()
    slug = model_slug(cfg.model)
    registry = AdapterRegistry(cfg.adapters_root, slug)
    store = Store(cfg.db_url)
    handle = open_queue(cfg)
    env = env_for(cfg.home)
    log = tmp_path / "workers.log"

    captures = THRESHOLD * (KILLS + 2) + 2 * KILLS
    for i in range(captures):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"question {i}")],
                                    response=f"answer number {i}", model="external"))
    sent: list[Rating] = []

    def rate(n: int) -> None:
        for _ in range(n):
            ev = Rating(target=f"c{len(sent)}", value=1 if len(sent) % 3 else -1)
            enqueue_event(handle, ev)  # acknowledged to the user from here on
            sent.append(ev)

    def wait(what: str, cond, timeout: float):
        """``cond()`` once it is truthy; fails after ``timeout`` s in which training made no progress, or
        after PATIENCE × ``timeout`` in all (slow is not stuck: only a worker that stopped moving fails)."""
        now = time.monotonic()
        deadline, cap, seen = now + timeout, now + PATIENCE * timeout, progress()
        while True:
            got = cond()
            if got:
                return got
            now, moved = time.monotonic(), progress()
            if moved != seen:
                deadline, seen = min(now + timeout, cap), moved
            assert now < deadline, f"{what}: not within {timeout} s of progress\n{diagnose()}\n{tail(log)}"
            assert events.poll() is None, f"the events worker died\n{tail(log)}"
            time.sleep(0.02)

    def diagnose() -> str:
        with store.session() as s:
            runs = [(r.id, r.state, r.version, r.error) for r in s.query(TrainRun).order_by(TrainRun.id)]
        started = StartedJobRegistry(TRAIN_QUEUE, connection=handle.redis).get_job_ids(cleanup=False)
        return (f"runs {runs}; lock {handle.redis.get(train_lock_key(slug))}; {handle.train.count} train jobs "
                f"queued, started {started}; progress {handle.redis.hgetall(progress_key(slug))}; "
                f"{handle.waiting_events()} events waiting; {store.pending_count(slug)} ratings pending")

    def run_after(run_id: int, states: tuple[str, ...]):
        """The latest run if it is newer than ``run_id`` and in one of ``states``."""
        run = store.latest_run(slug)
        return run if run is not None and run.id > run_id and run.state in states else None

    def progress() -> tuple[str, int]:
        raw = handle.redis.hgetall(progress_key(slug))
        return (raw.get(b"phase", b"").decode(), int(raw.get(b"step", -1)))

    def reached(run_id: int, step: int) -> bool:
        return progress()[1] >= step or store.get_run(run_id).state != "running"

    def settled() -> bool:
        run = store.latest_run(slug)
        return (not handle.waiting_events() and not handle.events.count and not handle.train.count
                and run.state not in ("queued", "running") and not handle.redis.exists(train_lock_key(slug)))

    watch = CurrentWatch(registry.dir)
    watch.start()
    events = worker("events", env, log)
    trainer = worker("train", env, log)
    kills = resumed = 0
    landed: Counter[str] = Counter()  # where in a run the kills landed
    started = time.monotonic()
    try:
        for _ in range(KILLS):
            last = store.latest_run(slug)
            rate(THRESHOLD)  # reaches the threshold: the events worker queues one run
            run = wait("a training run starts", partial(run_after, last.id if last else 0, ("running",)), 30)
            # anywhere from loading the model (step 0) to saving and committing the adapter (step STEPS)
            wait("the run reaches its step", partial(reached, run.id, rng.randint(0, STEPS)), 30)
            # the model is preloaded, so a tiny run is a fraction of a second: kill soon after the step
            time.sleep(rng.uniform(0, 0.02))
            phase = progress()[0] or "after it"
            kill9(trainer)
            kills += 1
            assert current_problem(registry.dir) is None  # what the crash left on disk
            rate(rng.randint(0, 2))  # ratings keep coming while no trainer runs
            interrupted = store.get_run(run.id).state in ("queued", "running")
            landed[phase if interrupted else "after it"] += 1
            trainer = worker("train", env, log)  # what `rlfleet up` or a supervisor does
            if interrupted:  # it must resume by itself: nobody rates or asks for training meanwhile
                done = wait("training resumes after the restart",
                            partial(run_after, run.id, ("succeeded", "rejected")), RESUME_S)
                assert done.version and registry.exists(done.version), done.version
                resumed += 1
            assert current_problem(registry.dir) is None
        rate(THRESHOLD)  # the last restarted worker trains on
        wait("everything applied and trained", settled, RESUME_S)
        lock_left = handle.redis.exists(train_lock_key(slug))
    finally:
        watch.halt.set()
        watch.join(5)
        stop(trainer)
        stop(events)
        handle.close()
    elapsed = time.monotonic() - started

    found = stored_counts(cfg.db_url)
    versions = registry.versions()
    print(f"\nchaos/trainer: {kills} SIGKILLs of the training worker (landed: {dict(landed)}), {resumed} runs "
          f"resumed by themselves; {len(sent)} ratings sent, {len(sent)} acknowledged, {len(found)} found, "
          f"{sum(n - 1 for n in found.values())} doubled; versions {versions}, served {sorted(watch.seen)}, "
          f"{len(watch.problems)} bad CURRENT seen; {elapsed:.0f} s")
    assert kills == KILLS
    assert resumed >= KILLS // 2, "most kills should land inside a run: the test lost its teeth"
    assert not watch.problems, watch.problems
    assert set(found) == {ev.event_id for ev in sent}  # every acknowledged rating is there
    assert all(n == 1 for n in found.values())  # exactly once
    assert not lock_left  # no lock outlives its run
    current = registry.current()
    assert current is not None and current_problem(registry.dir) is None
    assert not [why for v in versions if (why := adapter_problem(registry.path(v)))]  # every version is whole
    assert not list(registry.dir.glob(".staging-*"))  # what the killed runs half-wrote was cleared away
    from peft import PeftModel

    from rlfleet.shared.models import load_model, resolve_model

    PeftModel.from_pretrained(load_model(resolve_model(cfg.model)), str(registry.path(current)))
