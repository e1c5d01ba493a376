"""Running workers: in this process (``rlfleet worker``), or as background children of ``chat``/``up``.

Both queues use RQ's non-forking ``SimpleWorker``: the training worker must keep the base model
loaded between runs, and the events worker gains nothing from a fork per tiny job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from rlfleet.shared.config import Config
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import EVENTS_QUEUE, TRAIN_QUEUE, QueueHandle, open_queue, train_lock_key
from rlfleet.shared.store import Store

QUEUES = {"events": [EVENTS_QUEUE], "train": [TRAIN_QUEUE], "all": [EVENTS_QUEUE, TRAIN_QUEUE]}


def recover(cfg: Config, handle: QueueHandle) -> list[str]:
    """Repair what a killed process left behind; returns what it did, for the log.

    - half-written adapter folders are removed and CURRENT agrees with the store;
    - a training run whose job is gone, failed or abandoned is marked failed and its lock released,
      and training is queued again if the ratings are still there (so it resumes by itself).
    """
    from rlfleet.worker.jobs import context, maybe_trigger, reconcile

    notes: list[str] = []
    reconcile(cfg)
    conn = handle.redis
    for name in (EVENTS_QUEUE, TRAIN_QUEUE):
        StartedJobRegistry(name, connection=conn).cleanup()  # abandoned jobs -> retried or failed
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    run = store.latest_run(slug)
    if run is not None and run.state in ("queued", "running"):
        job_id = f"rlfleet-train-{slug}-{run.id}"
        try:
            status = Job.fetch(job_id, connection=conn).get_status()
        except Exception:
            status = None
        if status not in (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
            store.fail_run(run.id, "interrupted: the training worker stopped during the run")
            conn.delete(train_lock_key(slug))
            notes.append(f"run {run.id} was interrupted; marked failed")
            msg = maybe_trigger(context(), conn)
            if msg:
                notes.append(msg)
    return notes


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def requeue_orphans(conn) -> int:
    """Events jobs left "started" by a worker that is gone (killed with SIGKILL, say) go back on the
    queue now, instead of when RQ's registry entry expires minutes later. A worker on this machine
    whose process is gone counts as dead; the events handlers are idempotent, so a job requeued by a
    race with a live worker that just took it only repeats a no-op."""
    import socket

    from rq import Worker
    from rq.exceptions import NoSuchJobError

    here = socket.gethostname()
    busy = set()
    for w in Worker.all(connection=conn):
        if w.hostname == here and not _pid_alive(w.pid):
            continue
        current = w.get_current_job_id()
        if current:
            busy.add(current)
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
    # A worker killed between taking a job off the queue and starting it leaves it in RQ's
    # intermediate list, in no registry: RQ only notices much later.
    from rq.intermediate_queue import IntermediateQueue

    intermediate = IntermediateQueue(queue.key, connection=conn)
    started = set(registry.get_job_ids(cleanup=False))
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


def run_worker(cfg: Config, which: str = "all", burst: bool = False, handle: QueueHandle | None = None) -> bool:
    """Work the queues named by ``which`` until stopped (or until empty with ``burst``)."""
    own = handle is None
    handle = handle or open_queue(cfg)
    try:
        if which in ("train", "all") and not burst:
            for note in recover(cfg, handle):
                logging.getLogger("rlfleet.worker").warning(note)
        if which in ("events", "all"):
            n = requeue_orphans(handle.redis)
            if n:
                logging.getLogger("rlfleet.worker").warning("requeued %d events left by a dead worker", n)
        queues = [Queue(q, connection=handle.redis) for q in QUEUES[which]]
        worker = SimpleWorker(queues, connection=handle.redis)
        # with_scheduler: failed events are retried after an interval (EVENT_RETRY), which only a
        # scheduling worker puts back on the queue; without it a retried rating would wait forever
        return worker.work(burst=burst, logging_level="WARNING", with_scheduler=True)
    finally:
        if own:
            handle.close()


PARENT_ENV = "RLFLEET_PARENT_PID"  # set for background workers: they stop when that process is gone


def stop_with_parent(poll: float = 2.0) -> None:
    """In a background worker: when the parent that started us dies without stopping us (killed
    with SIGKILL), stop like on SIGTERM (RQ finishes the job in hand) instead of running orphaned."""
    import threading

    parent = os.environ.get(PARENT_ENV)
    if not parent or not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_env(cfg: Config, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["RLFLEET_HOME"] = str(cfg.home)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class BackgroundWorkers:
    """The events and training workers as child processes, stopped cleanly with their parent."""

    def __init__(
        self, cfg: Config, which: tuple[str, ...] = ("events", "train"), bots: tuple[str, ...] = (),
        serve: bool = False, bridge: bool = False,
    ) -> None:
        self.cfg = cfg
        self.which = which
        self.bots = bots  # platforms whose bots run beside the workers (`rlfleet bot NAME`)
        self.serve = serve  # `rlfleet serve`, the bots' responder
        self.bridge = bridge  # `rlfleet bridge`, the agents' and gateways' HTTP ingress
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = cfg.home / "logs"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        commands = {name: ["rlfleet.worker", "--queue", name] for name in self.which}
        if self.serve:
            commands["serve"] = ["rlfleet.shared", "serve"]
        if self.bridge:
            commands["bridge"] = ["rlfleet.shared", "bridge"]
        commands.update({f"bot-{name}": ["rlfleet.shared", "bot", name] for name in self.bots})
        for name, argv in commands.items():
            log = open(self.log_path(name), "ab")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", *argv],
                env=worker_env(self.cfg, {PARENT_ENV: str(os.getpid())}),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in the terminal reaches us, and we stop them in order
            )
            log.close()

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.procs.items()}

    def log_path(self, name: str) -> Path:
        return self.log_dir / (f"worker-{name}.log" if name in self.which else f"{name}.log")

    def stop(self, grace: float = 10.0) -> None:
        # First SIGTERM: RQ finishes the job in hand. Second: it stops now (a training run is
        # abandoned, marked failed and re-queued by the next worker's recovery; no rating is lost).
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for p in self.procs.values():
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
