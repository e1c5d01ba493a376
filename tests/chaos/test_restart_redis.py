"""Crash and restart: SIGKILL Redis (append-only, fsync on every write) in the middle of a stream of
ratings, with an events worker running, and start it again on the same files. Every rating whose
enqueue returned is in the database exactly once; a sender that got an error is the only one allowed
to be missing; the worker that was running before the first outage is still the one running after
the last (it waits for Redis and carries on: nobody restarts it). Bounded in time; prints its counts."""

from __future__ import annotations

import random
import threading
import time

import redis
from chaosrig import env_for, stop, stored_counts, tail, worker
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry, StartedJobRegistry

from rlfleet.shared import inbox
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.job_names import HANDLE_EVENT
from rlfleet.shared.queue import EVENTS_QUEUE, enqueue_event, open_queue
from rlfleet.shared.store import Store

RATINGS, RESTARTS = 240, 4


def test_redis_restarts_lose_no_acknowledged_rating(chaos_home, own_redis, tmp_path):
    rng = random.Random(20261125)
    cfg = load_config(model="tiny")
    cfg.train.threshold = 100_000  # no training in the way
    cfg.save()
    store = Store(cfg.db_url)
    for i in range(RATINGS):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")],
                                    response=f"a{i}", model="tiny"))
    events = [Rating(target=f"c{i}", value=1 if i % 3 else -1) for i in range(RATINGS)]
    log = tmp_path / "worker.log"
    proc = worker("events", env_for(cfg.home), log)
    handle = open_queue(cfg)
    acked: list[Rating] = []
    refused: list[Rating] = []
    done = threading.Event()

    def send() -> None:
        """A steady stream, as bots and the bridge send: an enqueue either returns (acknowledged) or raises."""
        try:
            for ev in events:
                try:
                    enqueue_event(handle, ev)
                    acked.append(ev)
                except redis.RedisError:
                    refused.append(ev)  # the sender was told: it may retry, or tell its user
                    time.sleep(0.1)  # and backs off a little
                time.sleep(0.025)
        finally:
            done.set()

    time.sleep(2.0)  # the worker is up and working before the first outage
    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    outages = []
    try:
        for _ in range(RESTARTS):
            time.sleep(rng.uniform(0.3, 1.2))
            own_redis.kill9()
            down = rng.uniform(0.2, 2.0)  # some outages end before RQ notices, some outlast its retries
            outages.append(round(down, 1))
            time.sleep(down)
            own_redis.start()  # the same --dir: the append-only file brings back what it acknowledged
            assert proc.poll() is None, f"the worker died on a Redis outage\n{tail(log)}"
        assert done.wait(60), "the sender is stuck"
        check = redis.Redis.from_url(own_redis.url)
        started_reg = StartedJobRegistry(EVENTS_QUEUE, connection=check)
        scheduled = ScheduledJobRegistry(EVENTS_QUEUE, connection=check)  # retries after a failure
        deadline = time.monotonic() + 45
        taken = IntermediateQueue(handle.events.key, connection=check)  # taken off the queue, not started
        while (handle.waiting_events() or handle.events.count or started_reg.get_job_ids(cleanup=False)
               or scheduled.count or taken.get_job_ids()):
            assert time.monotonic() < deadline, (
                f"stuck: {handle.waiting_events()} events waiting, {handle.events.count} jobs queued, "
                f"{started_reg.get_job_ids(cleanup=False)} started, {scheduled.count} scheduled, "
                f"{taken.get_job_ids()} taken\n{tail(log)}")
            assert proc.poll() is None, f"the worker died after the outages\n{tail(log)}"
            time.sleep(0.1)
        survived = proc.poll() is None
    finally:
        stop(proc)
        handle.close()
    elapsed = time.monotonic() - started

    found = stored_counts(cfg.db_url)
    acked_ids = {ev.event_id for ev in acked}
    refused_ids = {ev.event_id for ev in refused}
    print(f"\nchaos/redis: {RESTARTS} Redis SIGKILLs (down {outages} s), {len(acked) + len(refused)} ratings sent, "
          f"{len(acked)} acknowledged, {len(refused)} refused with an error, {len(found)} found "
          f"({len(set(found) & refused_ids)} of the refused), {sum(n - 1 for n in found.values())} doubled, "
          f"worker restarted 0 times; {elapsed:.0f} s")
    assert survived
    assert len(acked) + len(refused) == RATINGS
    assert len(acked) >= RATINGS // 4, "too few ratings went through for the test to mean much"
    lost = acked_ids - set(found)
    assert not lost, f"lost acknowledged ratings: {_whereabouts(own_redis.url, lost)}"
    assert set(found) <= acked_ids | refused_ids
    assert all(n == 1 for n in found.values())  # exactly once
    said = log.read_text(errors="replace")
    assert "lost Redis" in said or "could not connect to Redis" in said, "the outages never reached the worker"


def _whereabouts(url: str, event_ids: set[str]) -> list[str]:
    """Where the inbox has lost ratings, and what their answers say (for the failure message)."""
    conn = redis.Redis.from_url(url)
    places = {name: b"\n".join(conn.lrange(key, 0, -1)) for name, key in
              (("inbox", inbox.INBOX), ("taken", inbox.TAKEN), ("dead", inbox.DEAD))}
    return [f"{e}: in {[n for n, blob in places.items() if e.encode() in blob] or 'no list'}, "
            f"answer {conn.get(inbox.result_key(e))!r}" for e in event_ids]


def test_a_job_stranded_by_a_lost_dequeue_reply_runs_after_the_outage(chaos_home, own_redis, tmp_path):
    """The race the stream above hits now and then, made certain: Redis moved a job into RQ's
    intermediate list (a worker's dequeue) and crashed before the worker got the reply. RQ retries the
    dequeue by itself and never looks there again; the worker puts the job back once Redis is up."""
    cfg = load_config(model="tiny")
    cfg.save()
    store = Store(cfg.db_url)
    store.apply_capture(Capture(capture_id="c0", prompt=[Message(role="user", content="q")], response="a",
                                model="tiny"))
    log = tmp_path / "worker.log"
    proc = worker("events", env_for(cfg.home), log)
    handle = open_queue(cfg)
    try:
        deadline = time.monotonic() + 20
        while not handle.redis.smembers("rq:workers"):  # idle in its blocking dequeue
            assert time.monotonic() < deadline and proc.poll() is None, tail(log)
            time.sleep(0.1)
        time.sleep(0.5)
        ev = Rating(target="c0", value=1)
        # the state a dequeue leaves when its reply is lost: the job saved and queued, its id moved from
        # the queue to the intermediate list (put there directly: a push to the queue would wake the worker)
        job = Job.create(HANDLE_EVENT, args=(ev.model_dump_json(),), connection=handle.redis, origin=EVENTS_QUEUE,
                         status=JobStatus.QUEUED)
        job.save()
        handle.redis.rpush(IntermediateQueue(handle.events.key, handle.redis).key, job.id)
        own_redis.kill9()
        time.sleep(0.5)
        own_redis.start()
        deadline = time.monotonic() + 30
        while ev.event_id not in stored_counts(cfg.db_url):
            assert time.monotonic() < deadline, f"the stranded job never ran: {job.get_status()}\n{tail(log)}"
            assert proc.poll() is None, f"the worker died on a Redis outage\n{tail(log)}"
            time.sleep(0.1)
    finally:
        stop(proc)
        handle.close()
    print("\nchaos/redis: a job stranded by a lost dequeue reply ran after the outage, the worker never restarted")
