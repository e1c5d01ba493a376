"""One training run end to end: the pending ratings in, a new adapter version out, promoted when the
run's own checks and the evaluation gate (worker/gate.py) pass.

A run trains in a staging folder and commits it as ``vNNNN`` only when complete; a failed run leaves
``CURRENT`` alone and says why in status. Retractions (ratings undone or replaced after they were
trained on) always train; fresh ratings lose their newest slice to the gate's held-out set, which
stays pending (never trained on in this run) and trains the next one. A sample of earlier ratings is
replayed beside them (worker/replay.py); the run does not consume those.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from rlfleet.shared.compute_thread import on_compute_thread
from rlfleet.shared.config import Config
from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.queue import progress_key, train_lock_key
from rlfleet.shared.registry import is_adapter
from rlfleet.shared.runs import STOPPED_ON_REQUEST, fail_interrupted
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.status import publish_snapshot

from .context import Context
from .gate import GateConfig, ModelScores, TowardHints, Verdict, judge, one_class, split_holdout
from .idle_work import LEASE, idle_work_due
from .presets import TrainConfig, for_trainer
from .push_schedule import schedule_push
from .replay import draw, wanted
from .samples import Progress, RunResult, TrainSample, drawn_by
from .scope_start import start_from_shared
from .trainer_cache import get_trainer
from .training.loop import NothingToLearn, halfway_steps
from .training.rewards import rating_reward, star_centres
from .trigger import LOCK_TTL

log = logging.getLogger("rlfleet.worker")
# Earlier ratings a run's reward model learns from: enough for a rare taste's few liked answers to add
# up over runs, few enough that their forward pass stays a small part of a run.
REWARD_MODEL_HISTORY = 256


def run_training_job(ctx: Context, conn: redis.Redis, run_id: int, slug: str) -> JobResult:
    """Run ``run_id`` and record how it ended, whatever happens; the training lock is let go after."""
    try:
        ctx = ctx.scoped(slug)  # a scope's run trains that scope's lineage (shared/scopes.py)
        return train_once(ctx, conn, run_id)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Redis went away mid-run: nothing was wrong with the ratings, so the run counts as interrupted
        # (queued again as soon as the worker is back on Redis: runner.recover), not as failed (which
        # would wait for half a threshold of new ratings first).
        fail_interrupted(ctx.store, ctx.slug, run_id, f"lost Redis during the run ({type(exc).__name__})")
        raise
    except NothingToLearn as exc:  # not a fault: its ratings stay pending and the next run waits for more
        ctx.store.fail_run(run_id, str(exc), state="skipped")
        return JobResult.done(f"training run {run_id} skipped: {exc}")
    except Exception as exc:  # a failed run leaves CURRENT alone and says why in status
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, RlfleetError):
            log.exception("training run %s failed", run_id)
            msg = f"{type(exc).__name__}: {msg}"
        ctx.store.fail_run(run_id, msg)
        return JobResult.failed(f"training run {run_id} failed: {msg}")
    except SystemExit:
        # RQ's stop on a second SIGTERM/Ctrl-C (its first waits for the job): a user's stop, not a fault.
        # Returning (not raising) ends the job quietly: RQ would log the exception with its whole
        # traceback. The worker then sees its stop request and exits; the next start runs it again.
        fail_interrupted(ctx.store, ctx.slug, run_id, f"{STOPPED_ON_REQUEST}; it runs again on the next start")
        log.warning("stopped during training run %s; it runs again on the next start", run_id)
        return JobResult.failed(f"training run {run_id} stopped")
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
        idle_work_due(slug)  # the next run's features, under whichever version is served now


def train_once(ctx: Context, conn: redis.Redis, run_id: int) -> JobResult:
    parent = ctx.registry.current() or start_from_shared(ctx)
    ctx.store.start_run(run_id, parent)
    board = ProgressBoard.start(conn, ctx.slug, run_id)
    rows = ctx.store.pending_ratings(ctx.slug, ctx.cfg.train.max_ratings)
    if not rows:
        ctx.store.fail_run(run_id, "nothing to train on: no pending ratings", state="skipped")
        return JobResult.done("nothing to train on")
    gcfg = gate_config(ctx.cfg)
    centres = star_centres(ctx.store.stars_given(ctx.cfg.model))
    inputs = with_earlier(ctx, run_id, RunInputs.of(rows, ctx.cfg.model, gcfg, centres), centres)
    candidate = train_candidate(ctx, run_id, inputs, parent, gcfg, board)
    return conclude(ctx, conn, run_id, inputs, candidate)


@dataclass(frozen=True)
class RunInputs:
    """The pending ratings of one run, split the way the run uses them, and what else it reads from
    the store (:func:`with_earlier`)."""

    train: list[TrainSample]  # what the run consumes: fresh ratings and retractions
    held: list[TrainSample]  # the gate's held-out slice of the fresh ratings
    retracted: list[int]  # rating ids whose earlier update this run takes back
    replayed: list[TrainSample] = field(default_factory=list)  # earlier ratings trained again, not consumed
    history: list[TrainSample] = field(default_factory=list)  # earlier ratings its reward model reads
    captured: list[list[dict]] = field(default_factory=list)  # prompts nobody rated, for exploration

    @classmethod
    def of(cls, rows: list[tuple[RatingRow, CaptureRow]], model: str, gcfg: GateConfig,
           centres: Mapping[str, float] | None = None) -> RunInputs:
        """``centres``: each person's usual stars (training/rewards.py), for the rewards of star ratings."""
        samples, retracted = [], []
        for rating, cap in rows:
            if rating.state != "active":
                retracted.append(rating.id)
            samples.append(rated_sample(rating, cap, model, centres))
        fresh = [s for s in samples if s.fixed_advantage is None]
        held: list[TrainSample] = []
        if gcfg.enabled:
            _, held = split_holdout(fresh, [s.reward for s in fresh], gcfg.holdout_frac, gcfg.min_holdout)
        held_ids = {s.rating_id for s in held}
        return cls([s for s in samples if s.rating_id not in held_ids], held, retracted)

    @property
    def fresh(self) -> list[TrainSample]:
        """The consumed samples that are new ratings (not retractions)."""
        return [s for s in self.train if s.fixed_advantage is None]

    @property
    def trained(self) -> list[TrainSample]:
        """Everything the run trains on: what it consumes, then the replayed ratings."""
        return self.train + self.replayed


def rated_sample(rating: RatingRow, cap: CaptureRow, model: str,
                 centres: Mapping[str, float] | None = None) -> TrainSample:
    """One rating as a training sample: a retraction (undone or replaced) takes its update back. Its
    reward is the thumb, refined by its stars against the person's usual ones (``centres``)."""
    retraction = rating.state != "active"
    ours = cap.model == model  # stored log-probs describe the policy that answered: ours, or useless
    reward = rating_reward(rating.value, rating.stars, (centres or {}).get(rating.actor, 0.0))
    return TrainSample(
        rating_id=rating.id, prompt=cap.prompt, response=cap.response, reward=reward,
        behaviour_logprobs=cap.behaviour_logprobs if ours else None,
        behaviour_token_ids=cap.behaviour_token_ids if ours else None,
        fixed_advantage=-(rating.advantage or 0.0) if retraction else None,
        complete=cap.finish_reason != "length",
        comment=None if retraction else rating.comment,
        answered_by=drawn_by(cap.adapter_version) if ours else None,
    )


def with_earlier(ctx: Context, run_id: int, inputs: RunInputs,
                 centres: Mapping[str, float] | None = None) -> RunInputs:
    """``inputs`` with what the run reads beyond its pending ratings, the pool of earlier ratings read
    once: the ones it replays, the user's newest earlier ones (at most :data:`REWARD_MODEL_HISTORY`)
    for its reward model, and, when it explores, the prompts of the newest answers nobody rated."""
    pool = ctx.store.replay_pool(ctx.slug)
    history = reward_history(ctx, pool, centres)
    captured = ctx.store.unrated_prompts(ctx.cfg.train.explore_prompts) if ctx.cfg.train.explore > 0 else []
    return replace(inputs, replayed=replay_samples(ctx, run_id, len(inputs.fresh), pool, centres), history=history,
                   captured=captured)


def reward_history(ctx: Context, pool: list[tuple[int, int]] | None = None,
                   centres: Mapping[str, float] | None = None) -> list[TrainSample]:
    """The user's newest earlier ratings (at most :data:`REWARD_MODEL_HISTORY`) that a run's reward
    model reads beside the run's own, from ``pool`` (default: the store's replay pool)."""
    pool = ctx.store.replay_pool(ctx.slug) if pool is None else pool
    return _earlier_samples(ctx, [rid for rid, _ in pool][-REWARD_MODEL_HISTORY:], centres)


def replay_samples(ctx: Context, run_id: int, n_new: int, pool: list[tuple[int, int]] | None = None,
                   centres: Mapping[str, float] | None = None) -> list[TrainSample]:
    """The earlier ratings run ``run_id`` replays beside its ``n_new`` fresh ones (worker/replay.py),
    drawn from ``pool`` (default: the store's replay pool)."""
    n = wanted(n_new, ctx.cfg.train.replay)
    if n == 0:
        return []
    ids = draw(ctx.store.replay_pool(ctx.slug) if pool is None else pool, n, run_id)
    return [replace(s, replayed=True) for s in _earlier_samples(ctx, ids, centres)]


def _earlier_samples(ctx: Context, ids: list[int], centres: Mapping[str, float] | None = None) -> list[TrainSample]:
    return [rated_sample(rating, cap, ctx.cfg.model, centres) for rating, cap in ctx.store.ratings_with_captures(ids)]


class ProgressBoard:
    """The run's progress in Redis, where status reads it (``shared.status.TrainingProgress``)."""

    def __init__(self, conn: redis.Redis, key: str) -> None:
        self.conn, self.key = conn, key

    @classmethod
    def start(cls, conn: redis.Redis, slug: str, run_id: int) -> ProgressBoard:
        board = cls(conn, progress_key(slug))
        conn.hset(board.key, mapping={"run_id": run_id, "phase": "loading", "step": 0, "total": 0, "tokens_per_s": 0})
        conn.expire(board.key, LOCK_TTL)
        return board

    def reporter(self, version: str) -> Callable[[Progress], None]:
        def report(p: Progress) -> None:
            self.conn.hset(self.key, mapping={"phase": p.phase, "step": p.step, "total": p.total,
                                              "tokens_per_s": round(p.tokens_per_s, 1), "version": version})

        return report


@dataclass(frozen=True)
class Candidate:
    """A trained version, committed to the registry, and what it takes to promote it or not."""

    version: str
    parent: str | None
    metrics: dict[str, Any]
    advantages: dict[int, float]  # per consumed fresh rating: the advantage its update used
    new_ema: float
    promote: bool
    reason: str | None


def train_candidate(ctx: Context, run_id: int, inputs: RunInputs, parent: str | None, gcfg: GateConfig,
                    board: ProgressBoard) -> Candidate:
    """Train, evaluate and commit the next version (a failure leaves no folder behind)."""
    with LEASE.run():  # the trainer is the run's: the worker's idle work lets go of it (idle_work.py)
        # On the thread the idle work computes on too (rlfleet.shared.compute_thread).
        return on_compute_thread(lambda: _train_candidate(ctx, run_id, inputs, parent, gcfg, board))


def _train_candidate(ctx: Context, run_id: int, inputs: RunInputs, parent: str | None, gcfg: GateConfig,
                     board: ProgressBoard) -> Candidate:
    trainer = get_trainer(ctx.cfg)
    tcfg = for_trainer(ctx.cfg.train, trainer)
    ema, _lineage = ctx.store.baseline(ctx.slug)
    version = ctx.registry.next_version()
    staging = ctx.registry.staging(version)
    # Beside the staging folder, not in it: a version folder holds the adapter and meta.json only; the
    # registry's clean-up of a crashed run's ".staging-*" folders takes this one too.
    halfway = staging.with_name(staging.name + "-halfway") if inputs.held and ctx.cfg.train.fallback else None
    started = time.time()
    report = board.reporter(version)
    try:
        parent_dir = ctx.registry.path(parent) if parent else None
        result = trainer.run(inputs.trained, ema, tcfg, parent_dir, staging, progress=report,
                             captured=inputs.captured, history=inputs.history, halfway_dir=halfway)
        verdict = None
        if inputs.held and result.promoted_ok:
            report(Progress(0, 1, 0.0, phase="evaluating"))
            refs = GateReferences.measure(trainer, inputs.held, parent_dir, gcfg, tcfg.max_tokens)
            verdict = refs.judge(trainer, staging)
            if not verdict.promote and halfway is not None and is_adapter(halfway):
                verdict = fall_back(refs, trainer, verdict, staging, halfway, halfway_steps(tcfg.steps))
        candidate = _judge(result, verdict, inputs, ema, tcfg, version, parent)
        if halfway is not None:
            ctx.registry.discard(halfway)
        ctx.registry.commit(staging, version, _meta(ctx, run_id, inputs, candidate, tcfg, started))
    except BaseException:
        ctx.registry.discard(staging)
        if halfway is not None:
            ctx.registry.discard(halfway)
        raise
    return candidate


def fall_back(refs: GateReferences, trainer: Any, refused: Verdict, staging: Path, halfway: Path,
              steps: int) -> Verdict:
    """The gate refused the run's version: judge the adapter saved after ``steps`` updates the same way.
    If it passes, it replaces the run's adapter in ``staging`` (the version is the smaller step); either
    way the verdict says what the full run did."""
    half = refs.judge(trainer, halfway)
    if not half.promote:
        reason = f"{refused.reason}; the version halfway through the run (step {steps}) too: {half.reason}"
        return replace(refused, reason=reason,
                       metrics={**refused.metrics, "fallback": "refused", "fallback_reason": half.reason})
    for f in halfway.iterdir():
        os.replace(f, staging / f.name)
    return replace(half, metrics={**half.metrics, "fallback": "halfway", "steps_served": steps,
                                  "refused_full": refused.reason})


def _judge(result: RunResult, verdict: Verdict | None, inputs: RunInputs, ema: float | None, tcfg: TrainConfig,
           version: str, parent: str | None) -> Candidate:
    from .objective import update_ema

    trained = [s.reward for s in inputs.fresh]  # replayed ratings moved the EMA once, in their own run
    new_ema = update_ema(ema, trained, tcfg.ema_decay) if trained else (ema if ema is not None else 0.0)
    fresh = {s.rating_id for s in inputs.fresh}
    reason = result.reason or (verdict.reason if verdict else None)
    gate_metrics = verdict.metrics if verdict else {"verdict": "unchecked" if not inputs.held else "rejected"}
    return Candidate(
        version=version, parent=parent,
        metrics={**result.metrics, **gate_metrics, "ema_before": ema, "ema_after": new_ema, "reason": reason},
        advantages={rid: adv for rid, adv in result.advantages.items() if rid in fresh},
        new_ema=new_ema, promote=result.promoted_ok and (verdict is None or verdict.promote), reason=reason,
    )


def _meta(ctx: Context, run_id: int, inputs: RunInputs, c: Candidate, tcfg: TrainConfig, started: float) -> dict:
    """The version's meta.json: its lineage, the ratings it used, its metrics and its configuration."""
    return {
        "version": c.version, "parent": c.parent, "model": ctx.cfg.model, "slug": ctx.slug, "run_id": run_id,
        "rating_ids": [s.rating_id for s in inputs.fresh],
        "heldout_rating_ids": sorted(s.rating_id for s in inputs.held),
        "retracted_rating_ids": inputs.retracted,
        "replayed_rating_ids": [s.rating_id for s in inputs.replayed],
        "advantages": c.advantages, "metrics": c.metrics,
        "config": dict(asdict(tcfg)),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 1),
    }


def conclude(ctx: Context, conn: redis.Redis, run_id: int, inputs: RunInputs, c: Candidate,
             trained: str | None = None, checked: str | None = None) -> JobResult:
    """Record the run's end; serve the candidate when the store promoted it. ``trained`` and ``checked``
    say what it trained on and how it was checked in the caller's words (an environment's turns and
    held-out returns); by default its ratings and the held-out ratings."""
    status = ctx.store.finish_run(
        run_id, model=ctx.slug, version=c.version, parent=c.parent, metrics=c.metrics, advantages=c.advantages,
        retracted=inputs.retracted, new_ema=c.new_ema, promote=c.promote, reason=c.reason,
    )
    if status == "active":
        ctx.registry.set_current(c.version)
        schedule_push(ctx, conn)
        if checked is None:
            checked = f", held-out check passed on {len(inputs.held)}" if inputs.held else ""
        replayed = f" and {len(inputs.replayed)} earlier ones" if inputs.replayed else ""
        trained = trained or f"{len(inputs.train)} ratings{replayed}"
        return JobResult.done(f"{c.version} is live (trained on {trained}{checked})", version=c.version)
    return JobResult.failed(f"{c.version} was not promoted: {c.reason or status}", version=c.version)


def gate_config(cfg: Config) -> GateConfig:
    return GateConfig(
        enabled=cfg.train.gate, holdout_frac=cfg.train.holdout_frac, min_holdout=cfg.train.min_holdout,
        max_kl_one_class=cfg.train.gate_one_class_kl, eval_temperature=cfg.chat.temperature, eval_top_p=cfg.chat.top_p,
        hint_top_k=cfg.train.hindsight_top_k if cfg.train.gate_hints else 0, hint_teacher=cfg.train.teacher,
    )


@dataclass(frozen=True)
class GateReferences:
    """What a candidate is judged against: the held-out ratings, the base's sampled answers on them
    and the parent measured once (a fallback candidate is judged against the same). The base's
    log-probs and entropy come from each candidate's own KL pass, which runs the base beside it."""

    pairs: list[tuple[list[dict], str]]
    rewards: list[float]
    base_sampled: list[list[int]]
    parent: ModelScores | None  # None: the parent is the base (measured beside each candidate)
    gcfg: GateConfig
    max_tokens: int
    hints: Any = None  # the held-out answers' words as the teacher reads them (scoring.HeldHints)
    parent_divergence: list[float] | None = None  # the parent's divergence from that teacher on them
    base_known: int = 0  # the base's sampled answers that were drawn before the gate (scoring.draw_held)

    @classmethod
    def measure(cls, trainer: Any, held: list[TrainSample], parent_dir: Path | None, gcfg: GateConfig,
                max_tokens: int) -> GateReferences:
        from .training.feature_memo import base_draws
        from .training.scoring import (
            GATE_SEED,
            held_hints,
            held_known,
            sample_answers,
            score_model,
            teacher_divergences,
        )

        pairs = [(s.prompt, s.response) for s in held]
        prompts = [p for p, _ in pairs]
        # The base's answers to a held-out prompt are remembered (the worker may have drawn them ahead).
        drawn = base_draws(trainer)
        known = held_known(trainer, prompts, gcfg, GATE_SEED, drawn)
        base_sampled = sample_answers(trainer, prompts, gcfg, GATE_SEED, drawn)
        # The parent is only needed for its margin: no sampling, no KL (a second pass, of the base).
        parent = None if parent_dir is None else score_model(
            trainer, pairs, parent_dir, replace(gcfg, eval_samples=0), max_tokens, with_kl=False
        )
        rewards = [s.reward for s in held]
        hints = divergence = None
        # Only a one-class held-out set reads the teacher: the words are its missing second side.
        if gcfg.hint_top_k > 0 and one_class(rewards):
            hints = held_hints(trainer, held, gcfg.hint_teacher, gcfg.hint_top_k, max_tokens)
            if hints is not None:
                divergence = teacher_divergences(trainer, hints, parent_dir)
        return cls(pairs, rewards, base_sampled, parent, gcfg, max_tokens, hints, divergence, known)

    def judge(self, trainer: Any, candidate_dir: Path) -> Verdict:
        from .training.scoring import score_beside_base, teacher_divergences

        cand, base = score_beside_base(trainer, self.pairs, candidate_dir, self.gcfg, self.max_tokens,
                                       self.base_sampled)
        toward = None
        if self.hints is not None and self.parent_divergence is not None:
            toward = TowardHints(self.parent_divergence, teacher_divergences(trainer, self.hints, candidate_dir))
        parent = base if self.parent is None else self.parent
        verdict = judge(self.rewards, base, parent, cand, self.gcfg, toward)
        return replace(verdict, metrics={**verdict.metrics, "gate_base_known": self.base_known})


def evaluate_candidate(
    trainer: Any, held: list[TrainSample], parent_dir: Path | None, candidate_dir: Path, gcfg: GateConfig,
    max_tokens: int,
) -> Verdict:
    """Measure base, parent and candidate on the held-out ratings and judge the candidate."""
    return GateReferences.measure(trainer, held, parent_dir, gcfg, max_tokens).judge(trainer, candidate_dir)
