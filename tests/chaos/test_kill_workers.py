"""Crash and restart: SIGKILL event workers at random moments while ratings stream in, with duplicate
deliveries (through the inbox, and as the old one-job-per-event kind); afterwards every rating
acknowledged (enqueued) is in the database exactly once, and nothing is left "started" by a dead
worker or "taken" by a dead drain. Bounded in time; prints its counts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from rq import Worker
from rq.registry import ScheduledJobRegistry, StartedJobRegistry
from sqlalchemy import func, select

from rlfleet.shared import inbox
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.job_names import HANDLE_EVENT
from rlfleet.shared.queue import EVENT_RETRY, EVENTS_QUEUE, enqueue_event, open_queue
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.store import Store

RATINGS, KILLS, DUPLICATES = 2400, 8, 80


def _worker(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlfleet.worker", "--queue", "events"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ready(worker: subprocess.Popen, handle) -> subprocess.Popen:
    """Wait until the new worker is registered and listening, so the next kill lands while it works."""
    deadline = time.monotonic() + 30
    while not any(w.pid == worker.pid for w in Worker.all(connection=handle.redis)):
        assert worker.poll() is None and time.monotonic() < deadline, "the events worker did not start"
        time.sleep(0.05)
    return worker


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
    worker = _ready(_worker(env), handle)
    kills = sent = dups = mid_batch = 0
    chunk = RATINGS // KILLS
    try:
        for k in range(KILLS):
            kill_from = rng.randrange(chunk // 4, chunk)  # mid-stream, as soon as the drain holds a batch
            killed = False
            for j, ev in enumerate(events[k * chunk:(k + 1) * chunk]):
                enqueue_event(handle, ev)  # acknowledged to the user from here on
                sent += 1
                if dups < DUPLICATES and rng.random() < 0.05:  # the same event delivered again
                    if dups % 2:
                        enqueue_event(handle, ev)
                    else:  # as a job of the one-job-per-event kind, racing the drain for the same row
                        handle.events.enqueue(HANDLE_EVENT, ev.model_dump_json(), retry=EVENT_RETRY)
                    dups += 1
                if not killed and j >= kill_from and handle.redis.llen(inbox.TAKEN):
                    worker.send_signal(signal.SIGKILL)
                    killed = True
            if not killed:  # the drain kept up with the stream: catch it on the tail of the chunk
                deadline = time.monotonic() + 5
                while not handle.redis.llen(inbox.TAKEN) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            mid_batch += bool(handle.redis.llen(inbox.TAKEN))  # a batch the dead drain had not finished
            kills += 1
            worker = _ready(_worker(env), handle)
        deadline = time.monotonic() + 60
        started = StartedJobRegistry(EVENTS_QUEUE, connection=handle.redis)
        scheduled = ScheduledJobRegistry(EVENTS_QUEUE, connection=handle.redis)  # retries after a failure
        while handle.waiting_events() or handle.events.count or started.get_job_ids(cleanup=False) or scheduled.count:
            assert time.monotonic() < deadline, (
                f"stuck: {handle.waiting_events()} events waiting, {handle.events.count} jobs queued, "
                f"{started.get_job_ids(cleanup=False)} started")
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
    print(f"\nchaos: {kills} SIGKILLs ({mid_batch} with a batch taken and not finished), {sent} ratings sent, "
          f"{dups} duplicate deliveries, {len(found)} found, {sum(n - 1 for n in found.values())} doubled")
    assert kills == KILLS
    assert mid_batch > 0, "no kill landed mid-batch: the test lost its teeth"
    assert set(found) == {ev.event_id for ev in events}  # every acknowledged rating is there
    assert all(n == 1 for n in found.values())  # exactly once
