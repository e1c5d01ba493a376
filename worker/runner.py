"""Hosting an RQ worker in this process: ``rlfleet worker``, ``python -m rlfleet.worker`` (what ``chat`` and
``up`` start as their children), and the queue a command works inline when no worker is running.

Both queues use RQ's non-forking ``SimpleWorker``: the training worker must keep the base model
loaded between runs, and the events worker gains nothing from a fork per tiny job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from rlfleet.shared import scopes
from rlfleet.shared.config import Config, redact_url
from rlfleet.shared.job_names import train_job_id
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import (
    EVENTS_QUEUE,
    TRAIN_QUEUE,
    QueueHandle,
    ensure_drain,
    inline_holder_alive,
    open_queue,
    train_lock_key,
)
from rlfleet.shared.redis_text import as_text
from rlfleet.shared.runs import fail_interrupted, was_interrupted, was_stopped
from rlfleet.shared.store import Store
from rlfleet.shared.workers import forget_dead_workers, live_workers

log = logging.getLogger("rlfleet.worker")

QUEUES = {"events": [EVENTS_QUEUE], "train": [TRAIN_QUEUE], "all": [EVENTS_QUEUE, TRAIN_QUEUE]}


def recover(cfg: Config, handle: QueueHandle) -> list[str]:
    """Repair what a killed process left behind; returns what it did, for the log.

    - half-written adapter folders are removed and CURRENT agrees with the store;
    - a training run whose job is gone, failed or abandoned is marked failed and its lock released,
      and training is queued again if the ratings are still there (so it resumes by itself), unless
      an admin paused automatic training;
    - a training lock that names an abandoned job is released.
    """
    from rlfleet.worker.version_commands import reconcile

    notes: list[str] = []
    reconcile(cfg)
    conn = handle.redis
    for name in (EVENTS_QUEUE, TRAIN_QUEUE):
        StartedJobRegistry(name, connection=conn).cleanup()  # abandoned jobs -> retried or failed
    model = model_slug(cfg.model)
    store = Store(cfg.db_url)
    for slug in [model, *store.scope_lineages(model)]:  # the shared lineage, then each scope's
        said = _recover_lineage(store, conn, slug)
        notes += [f"scope {scopes.split(slug)[1]}: {n}" for n in said] if scopes.is_scoped(slug) else said
    return notes


def _recover_lineage(store: Store, conn: redis.Redis, slug: str) -> list[str]:
    """:func:`recover`'s work on one lineage (the model's, or a scope's: shared/scopes.py)."""
    from rlfleet.worker.context import context
    from rlfleet.worker.trigger import is_claim, maybe_trigger

    notes: list[str] = []
    run = store.latest_run(slug)
    lock = train_lock_key(slug)
    released = False
    inline = inline_holder_alive(conn.get(lock))  # an agent training in its own process: no job
    if run is not None and run.state in ("queued", "running") and not inline:
        if _train_job_lost(conn, train_job_id(slug, run.id)):
            fail_interrupted(store, slug, run.id, "the training worker stopped during the run")
            conn.delete(lock)
            notes.append(f"run {run.id} was interrupted; marked failed")
            released = True
    elif run is not None and was_interrupted(run):
        released = True  # stopped for a reason outside its data (Redis lost mid-run, say): queue it again
    holder = conn.get(lock)
    if holder and not is_claim(holder) and (inline is False or (
            inline is None and _train_job_lost(conn, as_text(holder)))):
        # its run ended, but the worker died before letting go (killed in `train`'s cleanup)
        conn.delete(lock)
        notes.append("released the training lock of a dead worker")
        released = True
    if released and store.training_paused(slug):
        notes.append("automatic training is paused: nothing queued again (`rlfleet resume` or `rlfleet train`)")
    elif released:
        # a run the user stopped runs again as it was asked for, even one started below the threshold
        msg = maybe_trigger(context().scoped(slug), conn, force=run is not None and was_stopped(run))
        if msg:
            notes.append(msg)
    return notes


def _train_job_lost(conn, job_id: str) -> bool:
    """Whether training job ``job_id`` will never run to its end by itself (gone, ended, or abandoned).

    A non-forking worker killed mid-run (SIGKILL, the OOM killer, a power cut) leaves its job
    "started" until the job's timeout, a day for training: RQ renews no heartbeat while a SimpleWorker
    runs a job, so its own cleanup would notice only then, and until then the training lock stayed
    held and training never resumed. A started job that no live worker is running is abandoned now.
    Likewise a queued job that a worker killed between dequeuing and starting left in RQ's
    intermediate list (RQ fails those only after minutes of maintenance passes). Both are marked
    failed in RQ, so nothing else waits on them."""
    from rq.intermediate_queue import IntermediateQueue

    try:
        job = Job.fetch(job_id, connection=conn)
    except NoSuchJobError:
        return True
    status = job.get_status()
    if status in (JobStatus.DEFERRED, JobStatus.SCHEDULED):
        return False
    if status == JobStatus.QUEUED:
        queue = Queue(job.origin, connection=conn)
        if job_id not in IntermediateQueue(queue.key, connection=conn).get_job_ids() or job_id in _busy_jobs(conn):
            return False
    elif status == JobStatus.STARTED:
        if job_id in _busy_jobs(conn):
            return False
    else:
        return True
    _bury(conn, job, "abandoned: the worker running it died")
    return True


def _bury(conn, job: Job, why: str) -> None:
    """Take an abandoned job out of RQ's started registry and intermediate list and mark it failed."""
    from rq.intermediate_queue import IntermediateQueue
    from rq.job_lifecycle import record_job_failure

    queue = Queue(job.origin, connection=conn)
    registry = StartedJobRegistry(job.origin, connection=conn)
    for job_id, execution in registry.get_job_and_execution_ids(cleanup=False):
        if job_id == job.id:
            conn.zrem(registry.key, f"{job_id}:{execution}" if execution else job_id)
    IntermediateQueue(queue.key, connection=conn).remove(job.id)
    with conn.pipeline() as pipe:
        record_job_failure(job, why, pipe)
        pipe.execute()


def _busy_jobs(conn) -> set[str]:
    """Ids of the jobs live workers are running."""
    busy = set()
    for w in live_workers(conn):
        current = w.get_current_job_id()
        if current:
            busy.add(current)
    return busy


def requeue_orphans(conn) -> int:
    """Events jobs left "started" by a worker that is gone (killed with SIGKILL, say) go back on the
    queue now, instead of when RQ's registry entry expires minutes later. A worker on this machine
    whose process is gone counts as dead; the events handlers are idempotent, so a job requeued by a
    race with a live worker that just took it only repeats a no-op."""
    busy = _busy_jobs(conn)
    registry = StartedJobRegistry(EVENTS_QUEUE, connection=conn)
    queue = Queue(EVENTS_QUEUE, connection=conn)
    requeued = 0
    for job_id, execution in registry.get_job_and_execution_ids(cleanup=False):
        if job_id in busy:
            continue
        # RQ 3 keys started entries as "job:execution", which its own requeue() does not remove
        if not conn.zrem(registry.key, f"{job_id}:{execution}" if execution else job_id):
            continue  # another worker took care of it meanwhile
        try:
            queue.enqueue_job(Job.fetch(job_id, connection=conn), at_front=True)
            requeued += 1
        except NoSuchJobError:
            pass
    return requeued + requeue_stranded(conn, queue, busy)


def requeue_stranded(conn, queue: Queue, busy: set[str] | None = None) -> int:
    """Jobs in RQ's intermediate list of ``queue`` that no worker holds go back on the queue. A worker
    takes a job by moving it there; one killed before it starts the job, or a Redis crash between the
    move and its reply (or the fetch after it), leaves the job there, in no registry, and RQ notices
    only after minutes of maintenance passes."""
    from rq.intermediate_queue import IntermediateQueue

    busy = _busy_jobs(conn) if busy is None else busy
    started = set(StartedJobRegistry(queue.name, connection=conn).get_job_ids(cleanup=False))
    intermediate = IntermediateQueue(queue.key, connection=conn)
    requeued = 0
    for job_id in intermediate.get_job_ids():
        if job_id in busy or job_id in started:
            continue
        intermediate.remove(job_id)
        try:
            queue.enqueue_job(Job.fetch(job_id, connection=conn), at_front=True)
            requeued += 1
        except NoSuchJobError:
            pass
    return requeued


class _RecoveringQueue(Queue):
    """RQ retries a dequeue that failed on a Redis error by itself, so the worker carries on; but the
    failed attempt may have moved a job into the intermediate list already (the reply was lost, or the
    fetch after the move failed), where no worker looks. The next dequeue first puts such jobs back."""

    _lost_redis = False

    @classmethod
    def dequeue_any(cls, queues, timeout, connection, *args, **kwargs):
        if _RecoveringQueue._lost_redis:
            n = sum(requeue_stranded(connection, q) for q in queues)
            _RecoveringQueue._lost_redis = False
            if n:
                log.warning("requeued %d jobs a Redis outage left stranded", n)
        if any(q.name == EVENTS_QUEUE for q in queues) and ensure_drain(connection):
            log.warning("events were waiting with no drain queued (its producer or job died); queued one")
        try:
            return super().dequeue_any(queues, timeout, connection, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError):
            _RecoveringQueue._lost_redis = True
            raise


def give_way(nice: int) -> None:
    """Raise this process's niceness to ``nice`` (``train.nice``); never lowers it: a worker started under
    ``nice`` by its user keeps what it was given, and lowering it would need privileges. On Linux a
    niceness is each thread's own (new threads inherit their creator's), so every thread running now is
    set too."""
    tasks = Path("/proc/self/task")
    for tid in sorted(int(t) for t in os.listdir(tasks)) if tasks.is_dir() else [0]:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, nice)


def run_worker(cfg: Config, which: str = "all", burst: bool = False, handle: QueueHandle | None = None) -> bool:
    """Work the queues named by ``which`` until stopped (or until empty with ``burst``).

    A Redis outage does not end a long-running worker: RQ itself retries only while waiting for a
    job, and quits its loop when Redis goes away in the middle of one (or while it tidies up). Here
    the worker then says so, waits until Redis answers again, puts back what the interrupted worker
    held (the same recovery as at start) and works on: a Redis outage is not a death to restart it for.
    """
    own = handle is None
    # A standing training worker gives way to what answers people (`rlfleet train`, a burst in the
    # foreground, is what its user waits for); before the model's threads start: they inherit it.
    if which == "train" and not burst:
        give_way(cfg.train.nice)
    handle = handle or open_queue(cfg)
    if not burst:
        _schedulers_stop_with_worker()
        # not MLX: its arrays belong to the stream of the thread that made them
        if which in ("train", "all") and cfg.train.preload and cfg.train.device != "mlx":
            from rlfleet.worker.trainer_cache import preload_trainer

            preload_trainer(cfg)
        if which in ("train", "all"):
            from rlfleet.worker.idle_work import start_idle_work

            # after the preload (it waits for the model): the next run's features of earlier ratings
            start_idle_work(cfg, model_slug(cfg.model) if cfg.train.preload else None)
        if which in ("events", "all"):
            from rlfleet.worker.drain_job import warm_up

            try:
                warm_up()
            except Exception as exc:  # the first job meets the same problem and says so where it is seen
                log.warning("could not prepare the events worker (%s: %s)", type(exc).__name__, exc)
    worked = False
    try:
        while True:
            worker = None
            try:
                if not burst and forget_dead_workers(handle.redis):
                    log.warning("forgot the registrations of workers that died without tidying up")
                if which in ("train", "all") and not burst:
                    for note in recover(cfg, handle):
                        log.warning(note)
                if which in ("events", "all"):
                    n = requeue_orphans(handle.redis)
                    if n:
                        log.warning("requeued %d events left by a dead worker", n)
                queues = [_RecoveringQueue(q, connection=handle.redis) for q in QUEUES[which]]
                worker = SimpleWorker(queues, connection=handle.redis, queue_class=_RecoveringQueue)
                # with_scheduler: failed events are retried after an interval (EVENT_RETRY), which only a
                # scheduling worker puts back on the queue; without it a retried rating would wait forever
                worked = worker.work(burst=burst, logging_level="WARNING", with_scheduler=True) or worked
                if burst or worker._shutdown_requested_date is not None:  # stopped on request (SIGTERM, Ctrl-C)
                    return worked
                # RQ quit its loop on an error it logged above (Redis gone in the middle of a job, mostly)
                log.warning("the worker stopped without being asked to; it starts again when Redis answers")
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if burst:
                    raise
                log.warning("lost Redis at %s (%s: %s); the worker starts again when it answers",
                            redact_url(handle.url), type(exc).__name__, exc)
            time.sleep(1.0)  # no busy loop if the error is not Redis's
            if not _wait_for_redis(handle.redis):
                return worked
            if worker is not None:
                _forget(worker)
            log.warning("the worker starts again on Redis at %s", redact_url(handle.url))
    finally:
        if not burst and which in ("train", "all"):
            from rlfleet.worker.idle_work import stop_idle_work

            stop_idle_work()
        if own:
            handle.close()


def _wait_for_redis(conn) -> bool:
    """Block until Redis answers (True) or a stop signal arrives meanwhile (False)."""
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # RQ's handlers belong to the worker that quit
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        delay, said = 0.5, 0.0
        while not stopping:
            try:
                if conn.ping():
                    return True
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() - said > 30:
                    log.warning("waiting for Redis (%s); retrying every few seconds", type(exc).__name__)
                    said = time.monotonic()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        return False
    finally:  # until the next worker installs its own: a stop now just ends the process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _forget(worker: SimpleWorker) -> None:
    """Unregister a worker whose loop ended on a Redis error (its own teardown could not reach Redis):
    while registered with this live process's pid it would count as busy with the job it held, and
    that job would never be put back."""
    try:
        worker.register_death()
    except redis.RedisError:
        pass
    try:
        worker.unsubscribe()
    except Exception:  # noqa: BLE001 - the pubsub thread may be gone already
        pass


_SCHEDULER_WATCH = False


def _schedulers_stop_with_worker() -> None:
    """RQ forks its scheduler from the worker (``with_scheduler``) and stops it only on a clean shutdown:
    a worker killed with SIGKILL left it running as an orphan for good (one more process, holding the
    scheduler lock, after every such kill). The forked child watches its parent and stops with it."""
    global _SCHEDULER_WATCH
    if _SCHEDULER_WATCH:
        return
    _SCHEDULER_WATCH = True
    parent = os.getpid()

    def in_child() -> None:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's own clean stop: locks released

        threading.Thread(target=watch, name="worker-watch", daemon=True).start()

    os.register_at_fork(after_in_child=in_child)
