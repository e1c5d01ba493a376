"""RQ jobs: apply events to the store, trigger training, train, and the admin commands.

Every job returns a small JSON-able dict ``{"ok": bool, "message": str, ...}`` that the enqueuer
shows to the user. Bad input and refusals are answers, not exceptions (no RQ retry);
anything unexpected raises so RQ retries it, which the store's idempotency makes safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import redis
from rq import Queue, get_current_job

from rlfleet.shared.config import Config, load_config
from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.events import Capture, Command, Rating, Undo, parse_event
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import (
    EVENTS_QUEUE,
    PUSH_JOB,
    TRAIN_JOB,
    TRAIN_QUEUE,
    TRAINING_BUSY,
    job_is_over,
    progress_key,
    push_key,
    train_lock_key,
)
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.schema import TrainRun
from rlfleet.shared.status import build_status, publish_snapshot
from rlfleet.shared.store import Store
from rlfleet.worker.gate import GateConfig, Verdict, judge, split_holdout

log = logging.getLogger("rlfleet.worker")
LOCK_TTL = 24 * 3600  # a training run longer than this is treated as dead
CLAIM_TTL = 60  # seconds a trigger may take from claiming the training lock to queueing the job


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
    """One event as its own RQ job: how events travelled before the inbox (shared/inbox.py). Kept so
    jobs queued by an earlier version still apply after an upgrade; new events go through the drain."""
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
    conn = _redis()
    # The status snapshot costs more than applying a rating: under a burst only the event that
    # empties the queue publishes it (so the last word is always fresh); commands always do.
    if isinstance(event, Command) or not Queue(EVENTS_QUEUE, connection=conn).count:
        publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)
    return result


def warm_up() -> None:
    """Before the first event: open the store (migrations checked), read the config, import the
    drain. Otherwise the first event after a worker starts waits a fifth of a second for all that."""
    import rlfleet.worker.drain  # noqa: F401

    ctx = context()
    ctx.store.apply_many([], ctx.slug)
    ctx.store.pending_count(ctx.slug)


DRAIN_SECONDS = 30.0  # then a fresh drain job takes over: other jobs on the queue get a turn
# An empty inbox is waited on this long before the drain lets go: under a steady stream (a few events a
# second and up) the next one then wakes the drain at once, not a new RQ job (the tail of the latency).
DRAIN_LINGER = 0.25
SNAPSHOT_EVERY = 2.0  # seconds between status snapshots during a long drain
RECHECK = 1.0  # seconds a drain trusts its own count of ratings until the next training run


class _Snapshots:
    """Status stays fresh during a long drain: published every ``SNAPSHOT_EVERY`` seconds from a thread
    of its own, so the events arriving meanwhile do not wait behind its queries."""

    def __init__(self, ctx: Context, conn: redis.Redis) -> None:
        self.ctx, self.conn, self.stop = ctx, conn, threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlfleet-status-snapshot", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(SNAPSHOT_EVERY):
            try:
                publish_snapshot(self.ctx.cfg, self.ctx.store, self.conn, self.ctx.slug)
            except Exception as exc:  # the drain's own last snapshot says what is wrong, if it lasts
                log.warning("status snapshot failed: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> _Snapshots:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(SNAPSHOT_EVERY)  # a snapshot stuck on a dead connection must not hold the drain


@dataclass
class _Countdown:
    """``maybe_trigger`` for one drain: ratings until the next run are looked up once, counted down by
    the ratings the drain adds, and looked up again when they may have run out or after ``RECHECK``
    seconds (a run that consumed ratings, an import). Every miscount is on the early side (a re-rating
    counts as a new rating, an undo is not counted back), so it never looks up too late: two
    transactions fewer per batch."""

    need: int = 0
    checked: float = float("-inf")

    def __call__(self, ctx: Context, conn: redis.Redis, new_ratings: int) -> str | None:
        self.need -= new_ratings
        if self.need > 0 and time.monotonic() - self.checked < RECHECK:
            return None
        self.need, self.checked = ratings_until_run(ctx.store, ctx.slug, ctx.cfg.train.threshold), time.monotonic()
        return maybe_trigger(ctx, conn) if self.need == 0 else None


def drain_events() -> dict:
    """Apply the inbox's events in batches until it is empty (see shared/inbox.py)."""
    from rlfleet.shared import inbox
    from rlfleet.shared.queue import queue_drain
    from rlfleet.worker.drain import apply_batch
    from rlfleet.worker.syncer import Syncer

    ctx = context()
    conn = _redis()
    me = get_current_job().id
    started = last_work = time.monotonic()
    applied = 0
    trigger = _Countdown()
    bell = inbox.Doorbell(conn)
    with _Snapshots(ctx, conn), contextlib.closing(bell), Syncer(ctx.store, conn) as syncer:
        batch = inbox.take(conn, me, first=True)
        while True:
            if batch is None:
                return {"ok": True, "message": "another drain owns the inbox", "applied": applied}
            if not batch.items:
                idle = time.monotonic() - last_work
                if idle < DRAIN_LINGER:
                    bell.wait(DRAIN_LINGER - idle)
                else:
                    syncer.sync_now()  # nothing of this drain's may wait for a sync once it lets go
                    if inbox.release(conn, me):
                        break
                batch = inbox.take(conn, me)
                continue
            # the commit does not wait for the disk: the syncer does, beside the next batches
            results = apply_batch(ctx, conn, batch.items, run_command, trigger, durable=False)
            applied += len(results)
            last_work = time.monotonic()
            if last_work - started > DRAIN_SECONDS:
                inbox.answer(conn, results, batch, synced=False)
                syncer.sync_now()
                successor = inbox.hand_over(conn, me)
                if successor:
                    queue_drain(conn, successor)
                break
            batch = inbox.answer_and_take(conn, results, batch, me, synced=False)
            syncer.nudge()
    publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)
    return {"ok": True, "message": f"applied {applied} events", "applied": applied}


# ---- training trigger ---------------------------------------------------------------------------


INTERRUPTED_IN_A_ROW = 3


STOPPED_ON_REQUEST = "stopped on request"  # the user stopped the worker (Ctrl-C, /quit, `up` ended)


def was_interrupted(run: TrainRun) -> bool:
    """A run that failed for a reason outside its data (its worker died, Redis went away, it was stopped)."""
    return run.state == "failed" and (run.error or "").startswith("interrupted")


def was_stopped(run: TrainRun) -> bool:
    return was_interrupted(run) and (run.error or "").startswith(f"interrupted: {STOPPED_ON_REQUEST}")


def interrupted_streak(store: Store, slug: str, before: int | None = None) -> int:
    """How many of the model's latest runs (older than run ``before``) in a row were interrupted: their
    worker died or lost Redis. A run the user stopped says nothing about the run: it neither counts nor
    breaks the streak."""
    streak = 0
    for run in store.recent_runs(slug, 4 * INTERRUPTED_IN_A_ROW):
        if (before is not None and run.id >= before) or was_stopped(run):
            continue
        if not was_interrupted(run):
            break
        streak += 1
    return streak


def fail_interrupted(store: Store, slug: str, run_id: int, why: str) -> None:
    """Mark a run interrupted (retried at once); the last of a streak says it will not be, and why."""
    error = f"interrupted: {why}"
    in_a_row = 0 if why.startswith(STOPPED_ON_REQUEST) else interrupted_streak(store, slug, before=run_id) + 1
    if in_a_row >= INTERRUPTED_IN_A_ROW:
        error += (f" ({in_a_row} runs in a row: not retried until half a threshold of new ratings, or "
                  "`rlfleet train`; out of memory? see the training worker's log)")
    store.fail_run(run_id, error)


def ratings_until_run(store: Store, slug: str, threshold: int) -> int:
    """How many more new ratings start the next training run by themselves (0: the next rating does).

    Pending ratings reach the threshold. After a failed or rejected run its ratings are still pending:
    retrying on every new rating would train on nearly the same data again and again, so it also
    waits for half a threshold of new ones. An interrupted run is retried at once (nothing was wrong
    with its data), unless the last few all were: a run that kills its worker every time (the OOM
    killer, say) would otherwise loop forever."""
    need = threshold - store.pending_count(slug)
    last = store.latest_run(slug)
    if (last is not None and last.state in ("failed", "rejected") and last.started is not None
            and not (was_interrupted(last) and interrupted_streak(store, slug) < INTERRUPTED_IN_A_ROW)):
        need = max(need, max(1, threshold // 2) - store.pending_count(slug, since=last.started))
    return max(0, need)


def maybe_trigger(ctx: Context, conn: redis.Redis, force: bool = False) -> str | None:
    """Queue one training run when pending ratings reach the threshold; never two for one model."""
    if not force and ratings_until_run(ctx.store, ctx.slug, ctx.cfg.train.threshold):
        return None
    pending = ctx.store.pending_count(ctx.slug)
    if force and not ctx.store.pending_ratings(ctx.slug, 1):
        return "nothing to train on: no pending ratings"
    key = train_lock_key(ctx.slug)
    # "claiming" lives only for the moment between claiming and queueing: a worker killed in between
    # must not block training for a day (no job id to check it against); the job's id then holds it.
    if not conn.set(key, b"claiming", nx=True, ex=CLAIM_TTL):
        holder = conn.get(key)
        # (None: it expired just now, so nobody holds it)
        if holder == b"claiming" or (holder is not None and not job_is_over(conn, holder.decode())):
            return TRAINING_BUSY
        conn.delete(key)  # the worker holding it died: take over
        if not conn.set(key, b"claiming", nx=True, ex=CLAIM_TTL):
            return TRAINING_BUSY
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
_TRAINERS_LOCK = threading.Lock()  # a run that starts while the worker preloads waits for that load


def get_trainer(cfg: Config):
    """The base model stays loaded between runs: one Trainer per (model, device) per process."""
    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.worker.backends import make_trainer

    ref = resolve_model(cfg.model)
    device = pick_device(cfg.train.device)
    key = (ref.path + (ref.gguf_file or ""), device)
    with _TRAINERS_LOCK:
        if key not in _TRAINERS:
            _TRAINERS[key] = make_trainer(ref, device)
        return _TRAINERS[key]


def preload_trainer(cfg: Config) -> threading.Thread:
    """Load the model in the background as the training worker starts. A failure is only logged: the
    first run loads again and says why in status."""

    def load() -> None:
        started = time.monotonic()
        try:
            get_trainer(cfg)
        except Exception as exc:
            log.warning("could not preload %s (%s); the first training run will try again", cfg.model, exc)
        else:
            log.info("preloaded %s in %.1f s", cfg.model, time.monotonic() - started)

    thread = threading.Thread(target=load, name="rlfleet-preload", daemon=True)
    thread.start()
    return thread


def train(run_id: int, slug: str) -> dict:
    ctx = context()
    conn = _redis()
    try:
        if slug != ctx.slug:
            raise RlfleetError(f"this worker trains {ctx.slug}, not {slug}; start one with that model")
        return _train(ctx, conn, run_id)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Redis went away mid-run: nothing was wrong with the ratings, so the run counts as interrupted
        # (queued again as soon as the worker is back on Redis: runner.recover), not as failed (which
        # would wait for half a threshold of new ratings first).
        fail_interrupted(ctx.store, ctx.slug, run_id, f"lost Redis during the run ({type(exc).__name__})")
        raise
    except Exception as exc:  # a failed run leaves CURRENT alone and says why in status
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, RlfleetError):
            log.exception("training run %s failed", run_id)
            msg = f"{type(exc).__name__}: {msg}"
        ctx.store.fail_run(run_id, msg)
        return {"ok": False, "message": f"training run {run_id} failed: {msg}"}
    except SystemExit:
        # RQ's stop on a second SIGTERM/Ctrl-C (its first waits for the job): a user's stop, not a fault.
        # Returning (not raising) ends the job quietly: RQ would log the exception with its whole
        # traceback. The worker then sees its stop request and exits; the next start runs it again.
        fail_interrupted(ctx.store, ctx.slug, run_id, f"{STOPPED_ON_REQUEST}; it runs again on the next start")
        log.warning("stopped during training run %s; it runs again on the next start", run_id)
        return {"ok": False, "message": f"training run {run_id} stopped"}
    except BaseException:  # stopped mid-run another way (KeyboardInterrupt, say): say so, keep CURRENT, re-raise
        fail_interrupted(ctx.store, ctx.slug, run_id, "the training worker stopped during the run")
        raise
    finally:
        try:
            conn.delete(train_lock_key(slug))
            conn.delete(progress_key(slug))
            publish_snapshot(ctx.cfg, ctx.store, conn, ctx.slug)
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # Redis is gone: runner.recover releases the lock of this ended job once it is back


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

    # Retractions always train; fresh ratings lose their newest slice to the gate's held-out set,
    # which stays pending (never trained on in this run) and trains the next one.
    gcfg = gate_config(ctx.cfg)
    fresh = [s for s in samples if s.fixed_advantage is None]
    held: list[TrainSample] = []
    if gcfg.enabled:
        _, held = split_holdout(fresh, [s.reward for s in fresh], gcfg.holdout_frac, gcfg.min_holdout)
    held_ids = {s.rating_id for s in held}
    train_samples = [s for s in samples if s.rating_id not in held_ids]

    trainer = get_trainer(ctx.cfg)
    tcfg = presets.resolve(ctx.cfg.train, trainer.n_params, trainer.is_moe, device=str(trainer.device))
    ema, _lineage = ctx.store.baseline(ctx.slug)
    version = ctx.registry.next_version()
    staging = ctx.registry.staging(version)
    started = time.time()

    def report(p: Progress) -> None:
        conn.hset(pkey, mapping={"phase": p.phase, "step": p.step, "total": p.total,
                                 "tokens_per_s": round(p.tokens_per_s, 1), "version": version})

    try:
        parent_dir = ctx.registry.path(parent) if parent else None
        result = trainer.run(train_samples, ema, tcfg, parent_dir, staging, progress=report)
        verdict = None
        if held and result.promoted_ok:
            report(Progress(0, 1, 0.0, phase="evaluating"))
            verdict = evaluate_candidate(trainer, held, parent_dir, staging, gcfg, tcfg.max_tokens)
        trained = [s.reward for s in train_samples if s.fixed_advantage is None]
        new_ema = update_ema(ema, trained, tcfg.ema_decay) if trained else (ema if ema is not None else 0.0)
        promote_ok = result.promoted_ok and (verdict is None or verdict.promote)
        reason = result.reason or (verdict.reason if verdict else None)
        gate_metrics = verdict.metrics if verdict else {"verdict": "unchecked" if not held else "rejected"}
        metrics = {**result.metrics, **gate_metrics, "ema_before": ema, "ema_after": new_ema, "reason": reason}
        advantages = {rid: adv for rid, adv in result.advantages.items() if rid not in retracted}
        meta = {
            "version": version, "parent": parent, "model": ctx.cfg.model, "slug": ctx.slug, "run_id": run_id,
            "rating_ids": [s.rating_id for s in train_samples if s.fixed_advantage is None],
            "heldout_rating_ids": sorted(held_ids),
            "retracted_rating_ids": retracted, "advantages": advantages, "metrics": metrics,
            "config": {k: v for k, v in asdict(tcfg).items()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - started, 1),
        }
        ctx.registry.commit(staging, version, meta)
    except BaseException:
        ctx.registry.discard(staging)
        raise
    status = ctx.store.finish_run(
        run_id, model=ctx.slug, version=version, parent=parent, metrics=metrics, advantages=advantages,
        retracted=retracted, new_ema=new_ema, promote=promote_ok, reason=reason,
    )
    if status == "active":
        ctx.registry.set_current(version)
        schedule_push(ctx, conn)
        n = len(train_samples)
        checked = f", held-out check passed on {len(held)}" if held else ""
        return {"ok": True, "message": f"{version} is live (trained on {n} ratings{checked})", "version": version}
    return {"ok": False, "message": f"{version} was not promoted: {reason or status}", "version": version}


def gate_config(cfg: Config) -> GateConfig:
    return GateConfig(
        enabled=cfg.train.gate, holdout_frac=cfg.train.holdout_frac, min_holdout=cfg.train.min_holdout,
        max_kl_one_class=cfg.train.gate_one_class_kl,
    )


def evaluate_candidate(
    trainer, held: list, parent_dir: Path | None, candidate_dir: Path, gcfg: GateConfig, max_tokens: int
) -> Verdict:
    """Measure base, parent and candidate on the held-out ratings and judge the candidate."""
    from rlfleet.worker.training.scoring import score_model

    pairs = [(s.prompt, s.response) for s in held]
    rewards = [s.reward for s in held]
    base = score_model(trainer, pairs, None, gcfg, max_tokens)
    # The parent is only needed for its margin: no sampling.
    parent = base if parent_dir is None else score_model(
        trainer, pairs, parent_dir, replace(gcfg, eval_samples=0), max_tokens
    )
    cand = score_model(trainer, pairs, candidate_dir, gcfg, max_tokens)
    return judge(rewards, base, parent, cand, gcfg)


# ---- commands ---------------------------------------------------------------------------------------


def run_command(ctx: Context, cmd: Command) -> dict:
    """Carry out a command the ingress that sent it has already permitted (shared/permissions.py)."""
    if cmd.name == "status":
        return {"ok": True, "message": "status", "status": build_status(ctx.cfg, ctx.store, _redis(), ctx.slug)}
    if cmd.name == "train":
        msg = maybe_trigger(ctx, _redis(), force=True)
        queued = msg is not None and msg.startswith("training run")
        return {"ok": queued or "already" in (msg or ""), "message": msg or "nothing to do"}
    if cmd.name == "rollback":
        return rollback(ctx, cmd.args.get("version"))
    if cmd.name == "promote":
        return promote(ctx, str(cmd.args.get("version") or ""), bool(cmd.args.get("force")))
    if cmd.name == "reset":
        purged = ctx.store.reset(ctx.slug, bool(cmd.args.get("purge_ratings")))
        ctx.registry.set_current(None)
        schedule_push(ctx, _redis())
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
        schedule_push(ctx, _redis())
        return {"ok": True, "message": "rolled back to the base model", "version": None}
    refusal = _unservable(ctx, target)
    if refusal:
        return {"ok": False, "message": refusal}
    ctx.registry.set_current(target)
    ctx.store.set_active(ctx.slug, target)
    schedule_push(ctx, _redis())
    return {"ok": True, "message": f"now serving {target}", "version": target}


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


def promote(ctx: Context, version: str, force: bool) -> dict:
    """Serve ``version``; a version the gate rejected only with ``force``."""
    from rlfleet.worker.objective import update_ema

    refusal = _unservable(ctx, version, force)
    if refusal:
        return {"ok": False, "message": refusal}
    row = ctx.store.version(ctx.slug, version)
    if row.status != "rejected":
        ctx.registry.set_current(version)
        ctx.store.set_active(ctx.slug, version)
        schedule_push(ctx, _redis())
        return {"ok": True, "message": f"now serving {version}", "version": version}
    meta = ctx.registry.meta(version)
    decay = float(meta.get("config", {}).get("ema_decay", 0.99))
    consumed = ctx.store.force_promote(
        ctx.slug, version, {int(k): float(v) for k, v in meta.get("advantages", {}).items()},
        [int(r) for r in meta.get("retracted_rating_ids", [])],
        ema_after=lambda ema, rewards: update_ema(ema, rewards, decay),
    )
    ctx.registry.set_current(version)
    schedule_push(ctx, _redis())
    return {"ok": True, "message": f"now serving {version} (forced past the gate; {consumed} ratings consumed)",
            "version": version}


# ---- pushing the served adapter to inference servers (worker/push.py) -----------------------------


def schedule_push(ctx: Context, conn: redis.Redis) -> None:
    """Queue a push of whatever is served now; it runs beside the rest, so it never delays promotion."""
    if not ctx.cfg.push:
        return
    from rq import Queue

    Queue(EVENTS_QUEUE, connection=conn).enqueue(
        PUSH_JOB, ctx.slug, job_timeout=3600, result_ttl=24 * 3600, failure_ttl=7 * 24 * 3600,
        description=f"push {ctx.slug}")


def push_served(slug: str, only: str | None = None) -> dict:
    ctx = context()
    return run_push(ctx.cfg, ctx.registry, _redis(), only)


def run_push(cfg: Config, registry: AdapterRegistry, conn: redis.Redis, only: str | None = None) -> dict:
    """Push the served version to every target (or ``only`` one); each result is kept for `status`."""
    from rlfleet.worker.push import push_one

    targets = [t for t in cfg.push if only in (None, t.name)]
    version = registry.current()
    adapter_dir = registry.path(version) if version else None
    results = [push_one(t, cfg, version, adapter_dir) for t in targets]
    for r in results:
        conn.hset(push_key(registry.slug), r.target, json.dumps(r.as_dict()))
    failed = [r for r in results if r.ok is False]
    return {"ok": not failed, "message": "; ".join(f"{r.target}: {r.message}" for r in results) or "no push targets",
            "results": [r.as_dict() for r in results]}


def reconcile(cfg: Config) -> None:
    """At worker start: drop half-written versions and make CURRENT agree with the store."""
    store = Store(cfg.db_url)
    slug = model_slug(cfg.model)
    reg = AdapterRegistry(cfg.adapters_root, slug)
    reg.clean_staging()
    active = [v.version for v in store.versions(slug) if v.status == "active"]
    if active and reg.exists(active[-1]) and reg.current() != active[-1]:
        reg.set_current(active[-1])
