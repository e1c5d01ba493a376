"""RQ jobs: apply events to the store, trigger training, train, and the admin commands.

Every job returns a small JSON-able dict ``{"ok": bool, "message": str, ...}`` that the enqueuer
shows to the user. Bad input and permission refusals are answers, not exceptions (no RQ retry);
anything unexpected raises so RQ retries it, which the store's idempotency makes safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import redis
from rq import get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from rlfleet.shared.config import Config, load_config
from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.events import Capture, Command, Rating, Undo, parse_event
from rlfleet.shared.models import model_slug
from rlfleet.shared.permissions import may_command
from rlfleet.shared.queue import TRAIN_JOB, TRAIN_QUEUE, progress_key, train_lock_key
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.status import build_status, publish_snapshot
from rlfleet.shared.store import Store

log = logging.getLogger("rlfleet.worker")
LOCK_TTL = 24 * 3600  # a training run longer than this is treated as dead


@dataclass
class Context:
    cfg: Config
    store: Store
    slug: str
    registry: AdapterRegistry
    config_mtime: float


_CTX: Context | None = None


def context() -> Context:
    """Per-process state, rebuilt when config.toml changes (so `rlfleet init` applies without restarts)."""
    global _CTX
    cfg_path = load_config().config_path
    mtime = cfg_path.stat().st_mtime if cfg_path.exists() else 0.0
    if _CTX is None or _CTX.config_mtime != mtime:
        cfg = load_config()
        slug = model_slug(cfg.model)
        _CTX = Context(cfg, Store(cfg.db_url), slug, AdapterRegistry(cfg.adapters_root, slug), mtime)
    return _CTX


def _redis() -> redis.Redis:
    job = get_current_job()
    if job is None:
        raise RuntimeError("rlfleet jobs run inside an RQ worker")
    return job.connection


def handle_event(payload: str) -> dict:
    ctx = context()
    try:
        event = parse_event(payload)
        if isinstance(event, Capture):
            result = asdict(ctx.store.apply_capture(event))
        elif isinstance(event, Rating):
            result = asdict(ctx.store.apply_rating(event, ctx.slug))
            if result["ok"] and not result["duplicate"]:
                result["training"] = maybe_trigger(ctx, _redis())
        elif isinstance(event, Undo):
            result = asdict(ctx.store.apply_undo(event))
        else:
            result = run_command(ctx, event)
    except RlfleetError as exc:
        return {"ok": False, "message": str(exc)}
    publish_snapshot(ctx.cfg, ctx.store, _redis(), ctx.slug)
    return result


# ---- training trigger ---------------------------------------------------------------------------


def _lock_is_stale(conn: redis.Redis, job_id: bytes | None) -> bool:
    if not job_id:
        return True
    try:
        job = Job.fetch(job_id.decode(), connection=conn)
    except NoSuchJobError:
        return True
    return job.get_status() in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED, JobStatus.FINISHED)


def maybe_trigger(ctx: Context, conn: redis.Redis, force: bool = False) -> str | None:
    """Queue one training run when pending ratings reach the threshold; never two for one model."""
    pending = ctx.store.pending_count(ctx.slug)
    if not force and pending < ctx.cfg.train.threshold:
        return None
    if force and not ctx.store.pending_ratings(ctx.slug, 1):
        return "nothing to train on: no pending ratings"
    key = train_lock_key(ctx.slug)
    if not conn.set(key, b"claiming", nx=True, ex=LOCK_TTL):
        holder = conn.get(key)
        if holder == b"claiming" or not _lock_is_stale(conn, holder):
            return "a training run is already queued or running"
        conn.delete(key)  # the worker holding it died: take over
        if not conn.set(key, b"claiming", nx=True, ex=LOCK_TTL):
            return "a training run is already queued or running"
    run_id = ctx.store.create_run(ctx.slug)
    job_id = f"rlfleet-train-{ctx.slug}-{run_id}"
    conn.set(key, job_id.encode(), ex=LOCK_TTL)
    from rq import Queue

    Queue(TRAIN_QUEUE, connection=conn).enqueue(
        TRAIN_JOB, run_id, ctx.slug, job_id=job_id, job_timeout=LOCK_TTL, result_ttl=7 * 24 * 3600,
        failure_ttl=7 * 24 * 3600, description=f"train {ctx.slug} run {run_id}",
    )
    return f"training run {run_id} queued on {pending} ratings"


# ---- training -------------------------------------------------------------------------------------

_TRAINERS: dict[tuple[str, str], object] = {}


def get_trainer(cfg: Config):
    """The base model stays loaded between runs: one Trainer per (model, device) per process."""
    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.worker.trainer import Trainer

    ref = resolve_model(cfg.model)
    device = pick_device(cfg.train.device)
    key = (ref.path + (ref.gguf_file or ""), device)
    if key not in _TRAINERS:
        _TRAINERS[key] = Trainer(ref, device=device)
    return _TRAINERS[key]


def train(run_id: int, slug: str) -> dict:
    ctx = context()
    conn = _redis()
    try:
        if slug != ctx.slug:
            raise RlfleetError(f"this worker trains {ctx.slug}, not {slug}; start one with that model")
        return _train(ctx, conn, run_id)
    except Exception as exc:  # a failed run leaves CURRENT alone and says why in status
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, RlfleetError):
            log.exception("training run %s failed", run_id)
            msg = f"{type(exc).__name__}: {msg}"
        ctx.store.fail_run(run_id, msg)
        return {"ok": False, "message": f"training run {run_id} failed: {msg}"}
    except BaseException:  # stopped mid-run (Ctrl-C, shutdown): say so, keep CURRENT, re-raise
        ctx.store.fail_run(run_id, "interrupted: the training worker stopped during the run")
        raise
    finally:
        conn.delete(train_lock_key(slug))
        conn.delete(progress_key(slug))
        publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)


def _train(ctx: Context, conn: redis.Redis, run_id: int) -> dict:
    from rlfleet.worker import presets
    from rlfleet.worker.objective import update_ema
    from rlfleet.worker.samples import Progress, TrainSample

    parent = ctx.registry.current()
    ctx.store.start_run(run_id, parent)
    pkey = progress_key(ctx.slug)
    conn.hset(pkey, mapping={"run_id": run_id, "phase": "loading", "step": 0, "total": 0, "tokens_per_s": 0})
    conn.expire(pkey, LOCK_TTL)

    rows = ctx.store.pending_ratings(ctx.slug, ctx.cfg.train.max_ratings)
    if not rows:
        ctx.store.fail_run(run_id, "nothing to train on: no pending ratings", state="skipped")
        return {"ok": True, "message": "nothing to train on"}
    samples, retracted = [], []
    for rating, cap in rows:
        retraction = rating.state != "active"
        if retraction:
            retracted.append(rating.id)
        samples.append(
            TrainSample(
                rating_id=rating.id,
                prompt=cap.prompt,
                response=cap.response,
                reward=float(rating.value),
                # Stored log-probs describe the policy that answered; they only match if that is our model.
                behaviour_logprobs=cap.behaviour_logprobs if cap.model == ctx.cfg.model else None,
                behaviour_token_ids=cap.behaviour_token_ids if cap.model == ctx.cfg.model else None,
                fixed_advantage=-(rating.advantage or 0.0) if retraction else None,
            )
        )

    trainer = get_trainer(ctx.cfg)
    tcfg = presets.resolve(ctx.cfg.train, trainer.n_params, trainer.is_moe)
    ema, _lineage = ctx.store.baseline(ctx.slug)
    version = ctx.registry.next_version()
    staging = ctx.registry.staging(version)
    started = time.time()

    def report(p: Progress) -> None:
        conn.hset(pkey, mapping={"phase": p.phase, "step": p.step, "total": p.total,
                                 "tokens_per_s": round(p.tokens_per_s, 1), "version": version})

    try:
        parent_dir = ctx.registry.path(parent) if parent else None
        result = trainer.run(samples, ema, tcfg, parent_dir, staging, progress=report)
        fresh = [s.reward for s in samples if s.fixed_advantage is None]
        new_ema = update_ema(ema, fresh, tcfg.ema_decay) if fresh else (ema if ema is not None else 0.0)
        metrics = {**result.metrics, "ema_before": ema, "ema_after": new_ema}
        meta = {
            "version": version, "parent": parent, "model": ctx.cfg.model, "slug": ctx.slug, "run_id": run_id,
            "rating_ids": [s.rating_id for s in samples if s.fixed_advantage is None],
            "retracted_rating_ids": retracted, "metrics": metrics,
            "config": {k: v for k, v in asdict(tcfg).items()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - started, 1),
        }
        ctx.registry.commit(staging, version, meta)
    except BaseException:
        ctx.registry.discard(staging)
        raise
    status = ctx.store.finish_run(
        run_id, model=ctx.slug, version=version, parent=parent, metrics=metrics,
        advantages={rid: adv for rid, adv in result.advantages.items() if rid not in retracted},
        retracted=retracted, new_ema=new_ema, promote=result.promoted_ok, reason=result.reason,
    )
    if status == "active":
        ctx.registry.set_current(version)
        return {"ok": True, "message": f"{version} is live (trained on {len(samples)} ratings)", "version": version}
    return {"ok": False, "message": f"{version} was not promoted: {result.reason or status}", "version": version}


# ---- commands ---------------------------------------------------------------------------------------


def run_command(ctx: Context, cmd: Command) -> dict:
    if not may_command(cmd.name, cmd.actor, cmd.source):
        return {"ok": False, "message": f"/rl {cmd.name} is for admins only"}
    if cmd.name == "status":
        return {"ok": True, "message": "status", "status": build_status(ctx.cfg, ctx.store, _redis(), ctx.slug)}
    if cmd.name == "train":
        msg = maybe_trigger(ctx, _redis(), force=True)
        queued = msg is not None and msg.startswith("training run")
        return {"ok": queued or "already" in (msg or ""), "message": msg or "nothing to do"}
    if cmd.name == "rollback":
        return rollback(ctx, cmd.args.get("version"))
    if cmd.name == "reset":
        purged = ctx.store.reset(ctx.slug, bool(cmd.args.get("purge_ratings")))
        ctx.registry.set_current(None)
        extra = f"; {purged} ratings purged" if purged else "; ratings kept"
        return {"ok": True, "message": f"reset to the base model{extra}"}
    return {"ok": False, "message": f"unknown command {cmd.name!r}"}


def rollback(ctx: Context, target: object) -> dict:
    current = ctx.registry.current()
    if target in (None, ""):
        if current is None:
            return {"ok": False, "message": "already on the base model: nothing to roll back"}
        target = ctx.registry.meta(current).get("parent") or "base"
    target = str(target)
    if target == "base":
        ctx.registry.set_current(None)
        ctx.store.set_active(ctx.slug, None)
        return {"ok": True, "message": "rolled back to the base model", "version": None}
    if not ctx.registry.exists(target):
        known = ", ".join(ctx.registry.versions()) or "none yet"
        return {"ok": False, "message": f"no adapter version {target} (versions: {known})"}
    ctx.registry.set_current(target)
    ctx.store.set_active(ctx.slug, target)
    return {"ok": True, "message": f"now serving {target}", "version": target}


def reconcile(cfg: Config) -> None:
    """At worker start: drop half-written versions and make CURRENT agree with the store."""
    store = Store(cfg.db_url)
    slug = model_slug(cfg.model)
    reg = AdapterRegistry(cfg.adapters_root, slug)
    reg.clean_staging()
    active = [v.version for v in store.versions(slug) if v.status == "active"]
    if active and reg.exists(active[-1]) and reg.current() != active[-1]:
        reg.set_current(active[-1])
