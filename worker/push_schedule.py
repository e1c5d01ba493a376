"""When the served adapter goes to the inference servers (worker/push.py says how): a push job queued
after every change of what is served, and the push itself, whose result per target `status` shows."""

from __future__ import annotations

import json

import redis
from rq import Queue

from rlfleet.shared import scopes
from rlfleet.shared.config import Config
from rlfleet.shared.job_names import PUSH_JOB
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.queue import EVENTS_QUEUE, push_key
from rlfleet.shared.registry import AdapterRegistry

from .context import Context


def schedule_push(ctx: Context, conn: redis.Redis) -> None:
    """Queue a push of whatever is served now; it runs beside the rest, so it never delays promotion."""
    if not ctx.cfg.push:
        return
    Queue(EVENTS_QUEUE, connection=conn).enqueue(
        PUSH_JOB, ctx.slug, job_timeout=3600, result_ttl=24 * 3600, failure_ttl=7 * 24 * 3600,
        description=f"push {ctx.slug}")


def run_push(cfg: Config, registry: AdapterRegistry, conn: redis.Redis, only: str | None = None) -> JobResult:
    """Push the served version to every target (or ``only`` one); each result is kept for `status`."""
    from .push import push_one

    targets = [t for t in cfg.push if only in (None, t.name)]
    version = registry.current()
    adapter_dir = registry.path(version) if version else None
    scope = scopes.split(registry.slug)[1] if scopes.is_scoped(registry.slug) else None
    if scope is not None:  # a scope's versions go where a server holds many LoRAs side by side
        targets = [t for t in targets if t.kind == "vllm"]
    results = [push_one(t, cfg, version, adapter_dir, scope) for t in targets]
    for r in results:
        conn.hset(push_key(registry.slug), r.target, json.dumps(r.as_dict()))
    failed = [r for r in results if r.ok is False]
    message = "; ".join(f"{r.target}: {r.message}" for r in results) or "no push targets"
    return JobResult(not failed, message, {"results": [r.as_dict() for r in results]})
