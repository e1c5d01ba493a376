"""What the training worker does while it waits for the next run.

What a run does before its first update depends only on the ratings it will read and the version it
starts from (the one being served): its reward model reads the features of the user's earlier ratings
(up to :data:`~.orchestrate.REWARD_MODEL_HISTORY` of them) and of the pending ones, it samples and pools
answers to the newest rated prompts to explore them, and its reference and run-start passes read the
log-probs of all those answers. So the worker does that as soon as it is idle (after the model's load,
after each run, and again every :data:`IDLE_POLL` seconds once new ratings came in) and remembers it
(:mod:`.training.feature_memo`); the run then reads what is there and spends its time on the ratings
that came last. ``train.idle_features = false`` turns this off.

The trainer belongs to runs: a run takes :data:`LEASE` for its whole length, and the idle work looks
between two passes whether one is waiting, and lets go at once. It runs in a thread of the training
worker (not as a queued job: a run queued behind a job would wait for all of it), never in a worker
that only drains the queue (``--burst``), and never with the MLX trainer (its arrays belong to the
thread that made them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rlfleet.shared import allocator, scopes
from rlfleet.shared.compute_thread import on_compute_thread
from rlfleet.shared.config import Config

from .batching import ended_as_recorded
from .samples import TrainSample

log = logging.getLogger("rlfleet.worker")


class TrainerLease:
    """Who has the trainer: a run, which waits for it, or the idle work, which takes it only when free
    and gives it up at its next pass once a run asks. Whoever lets go of it with no run waiting gives
    the memory malloc kept for the trainer's work back (:func:`rlfleet.shared.allocator.release`): the
    next user of the trainer is not here yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0  # runs waiting for the trainer (a count: two may wait at once in one process)

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        self._wait(+1)
        try:
            self._lock.acquire()
        finally:
            self._wait(-1)
        try:
            yield
        finally:
            self._let_go()

    def _wait(self, delta: int) -> None:
        with self._count:
            self._waiting += delta

    @contextlib.contextmanager
    def idle(self) -> Iterator[bool]:
        """True (held for the block) when no run has the trainer or is waiting for it, else False."""
        got = not self.wanted() and self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._let_go()

    def _let_go(self) -> None:
        self._lock.release()
        if not self.wanted():
            allocator.release()

    def wanted(self) -> bool:
        """Whether a run is waiting for the trainer."""
        return self._waiting > 0


LEASE = TrainerLease()


class IdleWorker:
    """The thread that does the idle work of one training worker, lineage by lineage as runs end."""

    def __init__(self, work: Callable[[str, Callable[[], bool]], int], poll: float | None = None) -> None:
        self._work = work
        self._poll = poll  # seconds between looks at the lineages it worked on (None: only when due)
        self._due: list[str] = []
        self._seen: list[str] = []  # lineages it has worked on: looked at again every poll seconds
        self._busy = False
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="rlfleet-idle-work", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def due(self, slug: str) -> None:
        """Do ``slug``'s idle work when the trainer is next free."""
        with self._wake:
            if slug not in self._due:
                self._due.append(slug)
            self._wake.notify()

    def settled(self, timeout: float) -> bool:
        """Wait until nothing is due or being done (True), or ``timeout`` seconds (False)."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._due and not self._busy, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop at the next pass and wait for it (a worker that exits mid-pass would leave a torch
        thread running into the interpreter's shutdown)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _stop_now(self) -> bool:
        return self._stopping or LEASE.wanted()

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._busy = False
                self._wake.notify_all()
                while not self._due and not self._stopping:
                    if not self._wake.wait(self._poll) and self._poll is not None:
                        self._due = list(self._seen)  # new ratings since: the next run's work grew
                        break
                if self._stopping:
                    return
                if not self._due:
                    continue
                slug, self._busy = self._due.pop(0), True
                if slug not in self._seen:
                    self._seen.append(slug)
            started = time.monotonic()
            try:
                with LEASE.idle() as mine:
                    # On the thread the runs compute on: one of its own would keep an OpenMP team of
                    # its own, and every run's draws would slow (rlfleet.shared.compute_thread).
                    done = on_compute_thread(functools.partial(self._work, slug, self._stop_now)) if mine else 0
            except Exception as exc:  # the next run computes what this did not; say why, work on
                log.warning("idle work on %s stopped: %s: %s", slug, type(exc).__name__, exc)
                continue
            if done:
                log.info("did %d answers' and prompts' work of %s's next run ahead in %.1f s",
                         done, slug, time.monotonic() - started)


_IDLE: IdleWorker | None = None
IDLE_POLL = 5.0  # seconds between the idle work's looks for new ratings (a look that finds none costs a query)


def start_idle_work(cfg: Config, first: str | None) -> IdleWorker | None:
    """Start this training worker's idle work, beginning with lineage ``first`` (None: with the first
    run's, once it ends); None where it does not run (``train.idle_features`` off, or the MLX
    trainer)."""
    global _IDLE
    if not cfg.train.idle_features or cfg.train.device == "mlx":
        return None
    _IDLE = IdleWorker(warm_features, IDLE_POLL)
    _IDLE.start()
    if first is not None:
        _IDLE.due(first)
    return _IDLE


def idle_work_due(slug: str) -> None:
    """A run of ``slug`` ended: its next run's features are due (nothing where no idle work runs)."""
    if _IDLE is not None:
        _IDLE.due(slug)


def stop_idle_work() -> None:
    global _IDLE
    if _IDLE is not None:
        _IDLE.stop()
        _IDLE = None


def warm_features(slug: str, stop: Callable[[], bool]) -> int:
    """Do, under lineage ``slug``'s served version, what its next run would do first if it started now
    (each as the run does it, in the run's session and precision): pool the answers of its earlier
    ratings (:func:`.orchestrate.reward_history`) and of its pending ones, draw and pool the answers it
    would explore (:func:`.training.exploration.draw_ahead`), and, where it continues an adapter, the
    base's log-probs of those answers (its reference pass); only what is not remembered yet, and
    nothing when neither the ratings nor the version changed since the last time. Returns how many
    answers and prompts it did (fewer when ``stop()`` said to let go)."""
    from .context import context
    from .orchestrate import RunInputs, gate_config, reward_history
    from .trainer_cache import get_trainer
    from .training import feature_memo
    from .training.rewards import star_centres

    ctx = context().scoped(slug)
    if not ctx.cfg.train.idle_features:
        return 0
    current = ctx.registry.current()
    # A scope's first run may start from a copy of the shared version (worker/scope_start.py): unknown yet.
    ahead = current is not None or not scopes.is_scoped(ctx.slug)
    rows = ctx.store.pending_ratings(ctx.slug, ctx.cfg.train.max_ratings) if ahead else []
    explore = ctx.cfg.train.explore > 0 and bool(rows)
    # (the gate's base answers are drawn ahead for the newest of them too: the answer a user rates next)
    captured = ctx.store.unrated_prompts(ctx.cfg.train.explore_prompts) if explore or (
        rows and ctx.cfg.train.gate) else []
    trainer = get_trainer(ctx.cfg)
    # What the work depends on: the settings, the version, the pending ratings and the unrated prompts.
    mark = (ctx.config_mtime, current, tuple((r.id, r.state, r.value, r.stars) for r, _ in rows),
            json.dumps(captured))
    done_for = feature_memo.done_for(trainer)
    if done_for.get(ctx.slug) == mark or stop():  # (the model may have been loading until now)
        return 0
    centres = star_centres(ctx.store.stars_given(ctx.cfg.model))
    history = reward_history(ctx, None, centres)
    if not history and not rows:
        done_for[ctx.slug] = mark
        return 0
    gcfg = gate_config(ctx.cfg)
    inputs = RunInputs.of(rows, ctx.cfg.model, gcfg, centres)
    done = _warm(ctx, trainer, current, history, inputs.train + inputs.held, captured, len(inputs.held), stop)
    done += _draw_held(trainer, held_prompts(inputs.train, inputs.held, captured, gcfg.eval_samples), gcfg, stop)
    if not stop():
        done_for[ctx.slug] = mark
    return done


def held_prompts(train: list[TrainSample], held: list[TrainSample], captured: list[list[dict]], n: int
                 ) -> list[tuple[list[dict], int]]:
    """The prompts the gate's base answers (``n`` of them, cycling through the held-out prompts) may be
    asked for when the next rating starts the run, each with how many: the held-out split's as it is
    now, and those the next rating may bring into it (the newest fresh rating of each class not held
    out yet, as a held-out set grows by one; the newest answer nobody rated, the one a user rates
    next); each as often as a prompt of the split is sampled, at most."""
    if not held or n <= 0:
        return []
    per = -(-n // len(held))
    wanted: dict[str, tuple[list[dict], int]] = {}
    for s in held:  # a prompt held out twice is sampled twice as often
        key = json.dumps(s.prompt, sort_keys=True)
        wanted[key] = (s.prompt, (wanted[key][1] if key in wanted else 0) + per)
    fresh = [s for s in train if s.fixed_advantage is None]
    extra = [max(group, key=lambda s: s.rating_id or 0).prompt
             for group in ([s for s in fresh if s.reward > 0], [s for s in fresh if s.reward <= 0]) if group]
    for prompt in extra + list(captured[:1]):
        wanted.setdefault(json.dumps(prompt, sort_keys=True), (prompt, per))
    return list(wanted.values())


def _draw_held(trainer: Any, wanted: list[tuple[list[dict], int]], gcfg: Any, stop: Callable[[], bool]) -> int:
    """Draw the gate's base answers to each of ``wanted`` it does not hold yet (:func:`held_prompts`),
    prompt by prompt until ``stop()`` says to let go; returns how many prompts it drew for."""
    from .training.feature_memo import base_draws
    from .training.scoring import GATE_SEED, draw_held

    drawn = base_draws(trainer)
    done = 0
    for prompt, n in wanted:
        if stop():
            break
        done += draw_held(trainer, [(prompt, n)], gcfg, GATE_SEED, drawn, stop) > 0
    return done


def _warm(ctx: Any, trainer: Any, current: str | None, history: list[TrainSample], pending: list[TrainSample],
          captured: list[list[dict]], n_held: int, stop: Callable[[], bool]) -> int:
    from .presets import for_trainer
    from .training import exploration, feature_memo, reward_features

    tcfg = for_trainer(ctx.cfg.train, trainer)
    adapter_dir = ctx.registry.path(current) if current is not None else None
    # As the run's own ratings (ended_as_recorded): a cut-off answer trains without an end token.
    pending = [ended_as_recorded(s, trainer.tokenizer) for s in pending]
    with trainer.adapter(adapter_dir, tcfg, precision=tcfg.precision):
        memo = feature_memo.memo_for(trainer, adapter_dir, trainer.precision)
        done = reward_features.remember(trainer, pending + history, tcfg.max_tokens, memo.pooled, stop)
        prompts: list[list[dict]] = []
        if tcfg.explore > 0 and pending:
            # The run explores its newest training prompts; the newest pending ones it may hold out.
            prompts = exploration.prompts_to_explore(pending, tcfg.explore_prompts + n_held + 1, captured)
            done += exploration.draw_ahead(trainer, prompts, tcfg, memo, stop)
        if adapter_dir is not None and not stop():
            # The run's reference pass reads the base's log-probs of the same rows: pooled under the
            # base, the log-probs are kept beside the hidden states.
            base = feature_memo.memo_for(trainer, None, trainer.precision)
            with trainer.reference():
                done += reward_features.remember(trainer, pending, tcfg.max_tokens, base.pooled, stop,
                                                 base.logprobs)
                for prompt in prompts:
                    got = memo.drawn.get(exploration.draw_key(prompt, tcfg))
                    if got is None or stop():
                        break
                    exploration.pool_answers(trainer, prompt, got, tcfg, base.pooled)
        return done
