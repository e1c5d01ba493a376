"""What a training run's outcome means, and when the next one starts by itself: the rule the worker's
trigger follows, and what the terminal chat tells a person about a run that ended.

Questions over the store, and the one write that records an interrupted run in the shape they read;
no Redis, no RQ, no torch, so every front end may ask them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schema import TrainRun
    from .store import Store

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

    Pending ratings reach the threshold. After a failed, rejected or skipped run (one that had nothing
    to learn from them) its ratings are still pending:
    retrying on every new rating would train on nearly the same data again and again, so it also
    waits for half a threshold of new ones. An interrupted run is retried at once (nothing was wrong
    with its data), unless the last few all were: a run that kills its worker every time (the OOM
    killer, say) would otherwise loop forever."""
    need = threshold - store.pending_count(slug)
    last = store.latest_run(slug)
    if (last is not None and last.state in ("failed", "rejected", "skipped") and last.started is not None
            and not (was_interrupted(last) and interrupted_streak(store, slug) < INTERRUPTED_IN_A_ROW)):
        need = max(need, max(1, threshold // 2) - store.pending_count(slug, since=last.started))
    return max(0, need)
