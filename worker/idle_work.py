"""What the training worker does while it waits for the next run.

A run's reward model reads the features of the user's earlier ratings (up to
:data:`~.orchestrate.REWARD_MODEL_HISTORY` of them) under the version being served, the policy the next
run starts from. Neither changes until that run, so the worker computes them as soon as it is idle (after
the model's load, after each run) and remembers them (:mod:`.training.feature_memo`); the next run then
spends its time on its own answers only. ``train.idle_features = false`` turns this off.

The trainer belongs to runs: a run takes :data:`LEASE` for its whole length, and the idle work looks
between two passes whether one is waiting, and lets go at once. It runs in a thread of the training
worker (not as a queued job: a run queued behind a job would wait for all of it), never in a worker
that only drains the queue (``--burst``), and never with the MLX trainer (its arrays belong to the
thread that made them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from rlfleet.shared.config import Config

log = logging.getLogger("rlfleet.worker")


class TrainerLease:
    """Who has the trainer: a run, which waits for it, or the idle work, which takes it only when free
    and gives it up at its next pass once a run asks."""

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
            self._lock.release()

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
                self._lock.release()

    def wanted(self) -> bool:
        """Whether a run is waiting for the trainer."""
        return self._waiting > 0


LEASE = TrainerLease()


class IdleWorker:
    """The thread that does the idle work of one training worker, lineage by lineage as runs end."""

    def __init__(self, work: Callable[[str, Callable[[], bool]], int]) -> None:
        self._work = work
        self._due: list[str] = []
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
                    self._wake.wait()
                if self._stopping:
                    return
                slug, self._busy = self._due.pop(0), True
            started = time.monotonic()
            try:
                with LEASE.idle() as mine:
                    done = self._work(slug, self._stop_now) if mine else 0
            except Exception as exc:  # the next run computes what this did not; say why, work on
                log.warning("idle work on %s stopped: %s: %s", slug, type(exc).__name__, exc)
                continue
            if done:
                log.info("computed the features of %d earlier ratings of %s for its next run in %.1f s",
                         done, slug, time.monotonic() - started)


_IDLE: IdleWorker | None = None


def start_idle_work(cfg: Config, first: str | None) -> IdleWorker | None:
    """Start this training worker's idle work, beginning with lineage ``first`` (None: with the first
    run's, once it ends); None where it does not run (``train.idle_features`` off, or the MLX
    trainer)."""
    global _IDLE
    if not cfg.train.idle_features or cfg.train.device == "mlx":
        return None
    _IDLE = IdleWorker(warm_features)
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
    """Pool the answers of lineage ``slug``'s earlier ratings under its served version, as its next run
    will read them (:func:`.orchestrate.reward_history`, in the run's session and precision), where
    they are not remembered yet; returns how many it pooled (fewer when ``stop()`` said to let go)."""
    from .context import context
    from .orchestrate import reward_history
    from .presets import for_trainer
    from .trainer_cache import get_trainer
    from .training import feature_memo, reward_features

    ctx = context().scoped(slug)
    if not ctx.cfg.train.idle_features:
        return 0
    # (Earlier ratings are those a promoted run of the lineage consumed: a scope still waiting for its
    # first version, whose run may start from a copy of the shared one, has none.)
    history = reward_history(ctx)
    if not history or stop():
        return 0
    current = ctx.registry.current()
    trainer = get_trainer(ctx.cfg)
    tcfg = for_trainer(ctx.cfg.train, trainer)
    adapter_dir = ctx.registry.path(current) if current is not None else None
    if stop():  # (the model may have been loading until now)
        return 0
    with trainer.adapter(adapter_dir, tcfg, precision=tcfg.precision):
        rows = feature_memo.rows_for(trainer, adapter_dir, trainer.precision)
        return reward_features.remember(trainer, history, tcfg.max_tokens, rows, stop)
