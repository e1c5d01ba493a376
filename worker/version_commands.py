"""The admin commands (``/rl status|train|rollback|promote|reset|pause|resume``) and keeping the served
version in step with the store. Each command answers with a :class:`JobResult`; a refusal is an answer too."""

from __future__ import annotations

from typing import get_args

import redis

from rlfleet.shared import scopes
from rlfleet.shared.config import Config
from rlfleet.shared.events import Command, Source
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.models import model_slug
from rlfleet.shared.registry import AdapterRegistry, version_name
from rlfleet.shared.runs import ratings_until_run
from rlfleet.shared.status import build_status, publish_snapshot
from rlfleet.shared.store import Store

from .context import Context
from .push_schedule import schedule_push
from .trigger import maybe_trigger


def run_command(ctx: Context, conn: redis.Redis, cmd: Command) -> JobResult:
    """Carry out a command the ingress that sent it has already permitted (shared/permissions.py); with
    ``args.scope``, on that scope's own adapter (shared/scopes.py)."""
    if cmd.args.get("scope") is not None:
        try:
            key = scopes.parse_key(str(cmd.args["scope"]), get_args(Source))
        except ValueError as exc:
            return JobResult.failed(str(exc))
        ctx = ctx.scoped(scopes.lineage(ctx.slug, key))
        try:
            return _run(ctx, conn, cmd)
        finally:
            publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)  # what that scope's `/rl status` reads
    return _run(ctx, conn, cmd)


def _run(ctx: Context, conn: redis.Redis, cmd: Command) -> JobResult:
    if cmd.name == "status":
        return JobResult.done("status", status=build_status(ctx.cfg, ctx.store, conn, ctx.slug))
    if cmd.name == "train":
        msg = maybe_trigger(ctx, conn, force=True)
        queued = msg is not None and msg.startswith("training run")
        return JobResult(queued or "already" in (msg or ""), msg or "nothing to do")
    if cmd.name == "rollback":
        return rollback(ctx, conn, cmd.args.get("version"))
    if cmd.name == "promote":
        return promote(ctx, conn, str(cmd.args.get("version") or ""), bool(cmd.args.get("force")))
    if cmd.name == "reset":
        purged = ctx.store.reset(ctx.slug, bool(cmd.args.get("purge_ratings")))
        ctx.registry.set_current(None)
        schedule_push(ctx, conn)
        extra = f"; {purged} ratings purged" if purged else "; ratings kept"
        return JobResult.done(f"reset to the base model{extra}")
    if cmd.name == "pause":
        return pause(ctx)
    if cmd.name == "resume":
        return resume(ctx, conn)
    return JobResult.failed(f"unknown command {cmd.name!r}")


def pause(ctx: Context) -> JobResult:
    """Stop training runs from starting by themselves; an explicit ``train`` still starts one."""
    if not ctx.store.pause_training(ctx.slug, True):
        return JobResult.done("automatic training was already paused", paused=True)
    msg = ("automatic training paused: ratings are still recorded, but no run starts by itself until resume "
           "(an explicit train still runs)")
    run = ctx.store.latest_run(ctx.slug)
    if run is not None and run.state in ("queued", "running"):
        msg += f"; run {run.id}, already {run.state}, goes on"  # a pause holds back new runs only
    return JobResult.done(msg, paused=True)


def resume(ctx: Context, conn: redis.Redis) -> JobResult:
    """Let training runs start by themselves again, at once if the ratings already reach the threshold:
    the ratings that came in while paused would otherwise wait for one more."""
    was_paused = ctx.store.pause_training(ctx.slug, False)
    msg = "automatic training resumed" if was_paused else "automatic training was not paused"
    started = maybe_trigger(ctx, conn)
    if started is None:
        more = ratings_until_run(ctx.store, ctx.slug, ctx.cfg.train.threshold)
        if more:
            msg += f"; the next run starts after {more} more ratings"
    return JobResult.done(msg, paused=False, training=started)


def rollback(ctx: Context, conn: redis.Redis, target: object) -> JobResult:
    current = ctx.registry.current()
    if target in (None, ""):
        if current is None:
            return JobResult.failed("already on the base model: nothing to roll back")
        target = ctx.registry.meta(current).get("parent") or "base"
    target = str(target)
    if target == "base":
        if current is None:
            return JobResult.done("already on the base model", version=None)
        ctx.registry.set_current(None)
        ctx.store.set_active(ctx.slug, None)
        schedule_push(ctx, conn)
        return JobResult.done("rolled back to the base model", version=None)
    version = version_name(target)
    refusal = _unservable(ctx, version)
    if refusal:
        return JobResult.failed(refusal)
    if version == current:
        return JobResult.done(f"already serving {version}", version=version)
    ctx.registry.set_current(version)
    ctx.store.set_active(ctx.slug, version)
    schedule_push(ctx, conn)
    return JobResult.done(f"now serving {version}", version=version)


def _unservable(ctx: Context, version: str, force: bool = False) -> str | None:
    """Why ``version`` may not be served (None: it may)."""
    if not ctx.registry.exists(version):
        known = ", ".join(ctx.registry.versions()) or "none yet"
        return f"no adapter version {version} (versions: {known})"
    row = ctx.store.version(ctx.slug, version)
    if row is None or row.status == "stale":
        return f"{version} is from before a reset (an old lineage); train a new version instead"
    if row.status == "rejected" and not force:
        why = (row.metrics or {}).get("reason") or "it failed its checks"
        return f"{version} was rejected: {why}. `rlfleet promote {version} --force` serves it anyway"
    return None


def promote(ctx: Context, conn: redis.Redis, version: str, force: bool) -> JobResult:
    """Serve ``version``; a version the gate rejected only with ``force``."""
    from .training.advantages import update_ema  # (not .objective, which loads torch for it)

    version = version_name(version)
    refusal = _unservable(ctx, version, force)
    if refusal:
        return JobResult.failed(refusal)
    row = ctx.store.version(ctx.slug, version)
    assert row is not None  # _unservable found it
    if row.status != "rejected":
        ctx.registry.set_current(version)
        ctx.store.set_active(ctx.slug, version)
        schedule_push(ctx, conn)
        return JobResult.done(f"now serving {version}", version=version)
    meta = ctx.registry.meta(version)
    decay = float(meta.get("config", {}).get("ema_decay", 0.99))
    consumed = ctx.store.force_promote(
        ctx.slug, version, {int(k): float(v) for k, v in meta.get("advantages", {}).items()},
        [int(r) for r in meta.get("retracted_rating_ids", [])],
        ema_after=lambda ema, rewards: update_ema(ema, rewards, decay),
    )
    ctx.registry.set_current(version)
    schedule_push(ctx, conn)
    return JobResult.done(f"now serving {version} (forced past the gate; {consumed} ratings consumed)",
                          version=version)


def reconcile(cfg: Config) -> None:
    """At worker start: drop half-written versions and make CURRENT agree with the store."""
    store = Store(cfg.db_url)
    slug = model_slug(cfg.model)
    reg = AdapterRegistry(cfg.adapters_root, slug)
    reg.clean_staging()
    active = [v.version for v in store.versions(slug) if v.status == "active"]
    if active and reg.exists(active[-1]) and reg.current() != active[-1]:
        reg.set_current(active[-1])
