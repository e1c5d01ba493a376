"""The queue: Redis (an embedded server by default, or ``REDIS_URL``) and the two RQ queues.

Ingresses enqueue jobs by their import path (``rlfleet.worker.jobs.handle_event``), so a bot or the
bridge never imports the worker's code or torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Retry
from rq.job import Job, JobStatus

from .config import Config, redact_url
from .errors import QueueUnavailable
from .events import Capture, Command, Rating, Undo

EVENTS_QUEUE = "rlfleet:events"
TRAIN_QUEUE = "rlfleet:train"
HANDLE_EVENT = "rlfleet.worker.jobs.handle_event"
TRAIN_JOB = "rlfleet.worker.jobs.train"

# A worker killed mid-job leaves the job "started"; RQ's maintenance marks it abandoned and these
# retries put it back, and the store's idempotency makes the repeat harmless.
EVENT_RETRY = Retry(max=5, interval=[1, 2, 5, 10, 30])


def progress_key(slug: str) -> str:
    return f"rlfleet:progress:{slug}"


def train_lock_key(slug: str) -> str:
    return f"rlfleet:train:lock:{slug}"


def status_key(slug: str) -> str:
    return f"rlfleet:status:{slug}"


def push_key(slug: str) -> str:
    """Hash: push target name -> the JSON of its last push result."""
    return f"rlfleet:push:{slug}"


PUSH_JOB = "rlfleet.worker.jobs.push_served"


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


def enqueue_event(handle: QueueHandle, event: Capture | Rating | Undo | Command) -> Job:
    return handle.events.enqueue(
        HANDLE_EVENT,
        event.model_dump_json(),
        retry=EVENT_RETRY,
        result_ttl=3600,
        failure_ttl=7 * 24 * 3600,
        job_timeout=300,
        description=f"{event.type} {event.event_id}",
    )


def wait_for(job: Job, timeout: float) -> dict | None:
    """The job's return value once it finishes; None if it is still queued or running at ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        status = job.get_status(refresh=True)
        if status == JobStatus.FINISHED:
            return job.return_value(refresh=True)
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            exc = (job.latest_result().exc_string or "").strip().splitlines() if job.latest_result() else []
            return {"ok": False, "message": f"the worker failed on it: {exc[-1] if exc else status}"}
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)

