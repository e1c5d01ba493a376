"""The queue: Redis (an embedded server by default, or ``REDIS_URL``) and the two RQ queues.

Ingresses enqueue jobs by their import path (shared/job_names.py), so a bot or the bridge never
imports the worker's code or torch.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from . import inbox
from .config import Config, redact_url
from .errors import QueueUnavailable
from .events import Capture, Command, Rating, Undo
from .job_names import DRAIN_JOB
from .job_result import JobResult
from .redis_text import as_text

EVENTS_QUEUE = "rlfleet:events"
TRAIN_QUEUE = "rlfleet:train"

# A worker killed mid-job leaves the job "started"; RQ's maintenance marks it abandoned and these
# retries put it back, and the store's idempotency makes the repeat harmless.
EVENT_RETRY = Retry(max=5, interval=[1, 2, 5, 10, 30])


def progress_key(slug: str) -> str:
    return f"rlfleet:progress:{slug}"


def train_lock_key(slug: str) -> str:
    return f"rlfleet:train:lock:{slug}"


# The training lock's value: a training job's id, a trigger's claim, or a process training in its own
# thread (an environment agent without background=True): ``inline:<host>:<pid>``.
INLINE_HOLDER = "inline:"


def inline_holder() -> str:
    """The lock value of this process training inline."""
    return f"{INLINE_HOLDER}{socket.gethostname()}:{os.getpid()}"


def inline_holder_alive(value: bytes | str | None) -> bool | None:
    """None: ``value`` is not an inline holder; else whether that process may still be training (one on
    another machine is taken to be: its lock's TTL ends it)."""
    text = as_text(value) if value is not None else ""
    if not text.startswith(INLINE_HOLDER):
        return None
    host, _, pid = text[len(INLINE_HOLDER):].rpartition(":")
    if host != socket.gethostname():
        return True
    from .embedded_redis import pid_alive

    return pid.isdigit() and pid_alive(int(pid))


TRAINING_BUSY = "a training run is already queued or running"  # the trigger's answer while one is


def status_key(slug: str) -> str:
    return f"rlfleet:status:{slug}"


def push_key(slug: str) -> str:
    """Hash: push target name -> the JSON of its last push result."""
    return f"rlfleet:push:{slug}"


def announce_key(slug: str) -> str:
    return f"rlfleet:announce:{slug}"


@dataclass
class QueueHandle:
    """A live connection plus what it takes to give it back (the embedded server's lease)."""

    redis: redis.Redis
    url: str
    embedded: Any | None = None  # EmbeddedRedis when we run the server

    @property
    def events(self) -> Queue:
        return Queue(EVENTS_QUEUE, connection=self.redis)

    @property
    def train(self) -> Queue:
        return Queue(TRAIN_QUEUE, connection=self.redis)

    def waiting_events(self) -> int:
        """Events handed over and not applied yet."""
        return inbox.pending(self.redis)

    def close(self) -> None:
        if self.embedded is not None:
            self.embedded.release()
            self.embedded = None


def open_queue(cfg: Config) -> QueueHandle:
    """Connect to ``REDIS_URL`` or start/attach the embedded server for this data dir."""
    if cfg.redis_url:
        try:
            conn = redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=3, health_check_interval=30)
            conn.ping()
        except (redis.RedisError, ValueError) as exc:
            raise QueueUnavailable(
                f"cannot reach Redis at {redact_url(cfg.redis_url)} ({exc.__class__.__name__}); "
                "start it, fix REDIS_URL, or unset it to use the embedded server"
            ) from None
        return QueueHandle(conn, cfg.redis_url)
    from .embedded_redis import EmbeddedRedis

    emb = EmbeddedRedis(cfg.home)
    conn = emb.acquire()
    return QueueHandle(conn, emb.url, emb)


@contextmanager
def queue_for(cfg: Config) -> Iterator[QueueHandle]:
    handle = open_queue(cfg)
    try:
        yield handle
    finally:
        handle.close()


def enqueue_event(handle: QueueHandle, event: Capture | Rating | Undo | Command) -> inbox.Ticket:
    """Hand an event to the workers (through the inbox: see shared/inbox.py); once this returns it is
    in Redis and will be applied."""
    ticket, drain_id = inbox.push(handle.redis, event.event_id, event.model_dump_json())
    if drain_id is not None:
        queue_drain(handle.redis, drain_id)
    return ticket


def queue_drain(conn: redis.Redis, drain_id: str) -> Job:
    return Queue(EVENTS_QUEUE, connection=conn).enqueue(
        DRAIN_JOB, job_id=drain_id, retry=EVENT_RETRY, result_ttl=600, failure_ttl=7 * 24 * 3600,
        job_timeout=300, description="apply the events in the inbox",  # a drain hands over after 30 s
    )


def job_is_over(conn: redis.Redis, job_id: str) -> bool:
    """Whether RQ job ``job_id`` will not run (again): gone, finished, failed for good, stopped or
    canceled. Queued, started, scheduled and deferred jobs are not over."""
    try:
        status = Job.fetch(job_id, connection=conn).get_status()
    except NoSuchJobError:
        return True
    return status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED, JobStatus.FINISHED)


def ensure_drain(conn: redis.Redis) -> bool:
    """Queue a drain when events wait with nobody to apply them (or a dead drain's batches wait for a
    database sync): the producer that claimed the inbox died before queueing its drain, or the drain
    job failed for good (its retries spent while the database was down, say). True when it queued one."""
    if not inbox.pending(conn) and not inbox.unsynced(conn):
        return False
    owner = conn.get(inbox.OWNER)
    if owner is not None:
        if not job_is_over(conn, as_text(owner)):
            return False  # queued, running, or waiting for its retry
        # compare-and-delete: a drain that took over meanwhile keeps the inbox
        conn.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end",
                  1, inbox.OWNER, owner)
    drain_id = inbox.new_drain_id()
    if not inbox.claim(conn, inbox.OWNER, drain_id, inbox.OWNER_TTL):
        return False
    queue_drain(conn, drain_id)
    return True


def wait_for(ticket: inbox.Ticket | Job, timeout: float) -> dict | None:
    """What the worker made of an event (or ran a job into); None if it is still waiting at ``timeout``."""
    if isinstance(ticket, inbox.Ticket):
        return inbox.wait(ticket, timeout)
    return _wait_for_job(ticket, timeout)


def _wait_for_job(job: Job, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        status = job.get_status(refresh=True)
        if status == JobStatus.FINISHED:
            return job.return_value(refresh=True)
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            result = job.latest_result()
            exc = (result.exc_string or "").strip().splitlines() if result else []
            return JobResult.failed(f"the worker failed on it: {exc[-1] if exc else status}").to_dict()
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
