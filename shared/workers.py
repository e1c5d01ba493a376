"""Which RQ worker registrations belong to live workers.

RQ keeps a worker's registration until its TTL (minutes) when the worker dies without tidying up
(SIGKILL, the OOM killer, a power cut): counted as is, `status` showed workers that were gone, and
commands waited on an events worker that would never answer. A worker on this machine whose
process is gone is dead, whatever its registration says; one on another machine is trusted until
RQ's TTL drops it.
"""

from __future__ import annotations

import socket

import redis
from rq import Worker
from rq.worker import BaseWorker

from .embedded_redis import pid_alive


def _is_dead(worker: BaseWorker, here: str) -> bool:
    return worker.hostname == here and not (worker.pid and pid_alive(worker.pid))


def live_workers(conn: redis.Redis) -> list[BaseWorker]:
    here = socket.gethostname()
    return [w for w in Worker.all(connection=conn) if not _is_dead(w, here)]


def serving(conn: redis.Redis, queue: str) -> bool:
    """Whether a live worker listens on ``queue``."""
    return any(queue in w.queue_names() for w in live_workers(conn))


def forget_dead_workers(conn: redis.Redis) -> int:
    """Remove the registrations of dead workers on this machine; returns how many."""
    here = socket.gethostname()
    dead = [w for w in Worker.all(connection=conn) if _is_dead(w, here)]
    for w in dead:
        w.register_death()
    return len(dead)
