"""Crash and restart: SIGKILL event workers at random moments while ratings stream in, with duplicate
deliveries; afterwards every rating acknowledged (enqueued) is in the database exactly once, and
nothing is left "started" by a dead worker. Bounded in time; prints its counts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from rq.registry import ScheduledJobRegistry, StartedJobRegistry
from sqlalchemy import func, select

from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.queue import EVENT_RETRY, EVENTS_QUEUE, HANDLE_EVENT, enqueue_event, open_queue
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.store import Store

RATINGS, KILLS, DUPLICATES = 120, 8, 20


def _worker(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlfleet.worker", "--queue", "events"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_killed_event_workers_lose_and_double_nothing(chaos_home):
    rng = random.Random(20261123)
    cfg = load_config(model="tiny")
    cfg.train.threshold = 100_000  # no training in the way
    cfg.save()
    env = {**os.environ, "RLFLEET_HOME": str(cfg.home), "RLFLEET_MODEL": "tiny"}
    handle = open_queue(cfg)
    store = Store(cfg.db_url)
    for i in range(RATINGS):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")],
                                    response=f"a{i}", model="tiny"))
    events = [Rating(target=f"c{i}", value=1 if i % 3 else -1) for i in range(RATINGS)]
    worker = _worker(env)
    time.sleep(1.5)  # let it start: the kills below should land while it works
    kills = sent = dups = 0
    chunk = RATINGS // KILLS
    try:
        for k in range(KILLS):
            for ev in events[k * chunk:(k + 1) * chunk]:
                enqueue_event(handle, ev)  # acknowledged to the user from here on
                sent += 1
                if dups < DUPLICATES and rng.random() < 0.2:  # the same event delivered again
                    handle.events.enqueue(HANDLE_EVENT, ev.model_dump_json(), retry=EVENT_RETRY)
                    dups += 1
            time.sleep(rng.uniform(0.05, 0.25))  # mid-stream: the worker is applying one of them
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            kills += 1
            worker = _worker(env)
            time.sleep(1.0)
        deadline = time.monotonic() + 60
        started = StartedJobRegistry(EVENTS_QUEUE, connection=handle.redis)
        scheduled = ScheduledJobRegistry(EVENTS_QUEUE, connection=handle.redis)  # retries after a failure
        while handle.events.count or started.get_job_ids(cleanup=False) or scheduled.count:
            assert time.monotonic() < deadline, (
                f"stuck: {handle.events.count} queued, {started.get_job_ids(cleanup=False)} started")
            if worker.poll() is not None:
                worker = _worker(env)
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(20)
        handle.close()
    with store.session() as s:
        rows = s.execute(select(RatingRow.event_id, func.count()).group_by(RatingRow.event_id)).all()
    found = {event_id: n for event_id, n in rows}
    print(f"\nchaos: {kills} SIGKILLs, {sent} ratings sent, {dups} duplicate deliveries, "
          f"{len(found)} found, {sum(n - 1 for n in found.values())} doubled")
    assert kills == KILLS
    assert set(found) == {ev.event_id for ev in events}  # every acknowledged rating is there
    assert all(n == 1 for n in found.values())  # exactly once
