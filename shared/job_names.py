"""The RQ jobs by name: what producers enqueue, and what RQ imports in the worker to run them.

Producers (the bots, the bridge, the CLI) enqueue a job by its import path, never by importing the
worker, so none of them loads the worker's code or torch. The paths are also a contract with the jobs
already waiting in users' Redis: RQ looks each one up again when it runs it, so a path here is never
renamed (``rlfleet.worker.jobs`` keeps every one importable).
"""

from __future__ import annotations

import hashlib
import re

HANDLE_EVENT = "rlfleet.worker.jobs.handle_event"  # one event per job: only jobs queued before the inbox
DRAIN_JOB = "rlfleet.worker.jobs.drain_events"  # applies the inbox's events (shared/inbox.py)
TRAIN_JOB = "rlfleet.worker.jobs.train"  # one training run: (run id, model slug)
PUSH_JOB = "rlfleet.worker.jobs.push_served"  # the served adapter to the inference servers: (model slug)
GYM_RUN_JOB = "rlfleet.worker.jobs.gym_run"  # an environment agent's run: (GymRunRequest JSON)

ALL = (HANDLE_EVENT, DRAIN_JOB, TRAIN_JOB, PUSH_JOB, GYM_RUN_JOB)


def train_job_id(slug: str, run_id: int) -> str:
    """The RQ job id of training run ``run_id`` of ``slug`` (a model, or a scope's lineage): the training
    lock holds it, and recovery looks it up. RQ takes letters, digits, ``_`` and ``-`` only."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", slug)
    if name != slug:  # a scope's lineage (shared/scopes.py): told apart by a hash of its whole name
        name = f"{name[:80]}-{hashlib.sha256(slug.encode()).hexdigest()[:12]}"
    return f"rlfleet-train-{name}-{run_id}"
