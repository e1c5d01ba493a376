"""The RQ jobs, by the names producers enqueue them under (shared/job_names.py): thin entry points
that take the process's context and the job's Redis connection and hand over to the module that does
the work. RQ jobs already waiting in users' Redis name these paths, so each stays importable here.

Every job returns a :class:`~rlfleet.shared.job_result.JobResult` in its wire form, which the enqueuer
shows to the user. Bad input and refusals are answers, not exceptions (no RQ retry);
anything unexpected raises so RQ retries it, which the store's idempotency makes safe.
"""

from __future__ import annotations

from .context import context, current_job
from .drain_job import apply_one, drain
from .push_schedule import run_push


def handle_event(payload: str) -> dict:
    """One event as its own job: only jobs queued before the inbox existed still come this way."""
    return apply_one(context(), current_job().connection, payload).to_dict()


def drain_events() -> dict:
    """Apply the inbox's events in batches until it is empty (see shared/inbox.py)."""
    job = current_job()
    return drain(context(), job.connection, job.id).to_dict()


def train(run_id: int, slug: str) -> dict:
    """Training run ``run_id`` of model ``slug`` (queued by worker/trigger.py)."""
    from .orchestrate import run_training_job  # (here: an events worker imports this module, not torch)

    return run_training_job(context(), current_job().connection, run_id, slug).to_dict()


def gym_run(payload: str) -> dict:
    """An environment agent's run (rlfleet.gym's ``background=True``): train and commit its candidate;
    the agent judges and serves it (worker/agent_runs.py)."""
    from .agent_runs import run_in_worker

    return run_in_worker(current_job().connection, payload)


def push_served(slug: str, only: str | None = None) -> dict:
    """The served adapter to the inference servers (queued by worker/push_schedule.py)."""
    ctx = context().scoped(slug)  # the model's shared adapter, or a scope's own (shared/scopes.py)
    return run_push(ctx.cfg, ctx.registry, current_job().connection, only).to_dict()
