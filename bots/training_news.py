"""What the terminal chat says about training while the user chats: the progress line, one message the
moment a run ends (promoted and what changed, or not and why, and what happens next), and the
trigger's "already running" answer once per run instead of after every rating.

It only reads the store and Redis; the chat decides where the lines go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from rlfleet.shared.queue import TRAINING_BUSY
from rlfleet.shared.runs import ratings_until_run, was_interrupted
from rlfleet.shared.schema import TrainRun
from rlfleet.shared.store import Store

ENDED = ("succeeded", "rejected", "failed", "stale", "skipped")
WATCHED_RUNS = 5  # runs looked at per poll: more than can end between two polls


@dataclass
class News:
    progress: str | None  # the live line while a run is queued or running, else None
    ended: list[str] = field(default_factory=list)  # one message per run that ended since the last poll


@dataclass
class TrainingNews:
    store: Store
    conn: redis.Redis | None
    slug: str
    threshold: int
    _states: dict[int, str] = field(default_factory=dict)
    _first: int = 0  # runs up to this one ended before the chat started: old news
    _busy_said: int | None = None  # the run the "already running" answer was shown for

    def __post_init__(self) -> None:
        runs = self.store.recent_runs(self.slug, WATCHED_RUNS)
        self._states = {r.id: r.state for r in runs}
        self._first = max(self._states, default=0)

    def poll(self) -> News:
        from rlfleet.shared.status import training_state

        ended = []
        for run in reversed(self.store.recent_runs(self.slug, WATCHED_RUNS)):
            before = self._states.get(run.id)
            self._states[run.id] = run.state
            if run.state in ENDED and before != run.state and (before is not None or run.id > self._first):
                ended.append(self.ended_message(run))
        return News(progress_line(training_state(self.store, self.conn, self.slug)), ended)

    def ended_message(self, run: TrainRun) -> str:
        m = run.metrics or {}
        if run.state == "succeeded":
            before, after = m.get("heldout_margin_before"), m.get("heldout_margin_after")
            check = (f"held-out margin {before:+.3f} → {after:+.3f}" if before is not None and after is not None
                     else "no held-out check")
            used = m.get("ratings_used")
            halfway = (f" (the step from halfway through the run: the whole run was refused, {m.get('refused_full')})"
                       if m.get("fallback") == "halfway" else "")
            vouched = (" (only 👎s held out: it came nearer what their words asked)"
                       if m.get("heldout_toward_teacher") else "")
            return f"✓ {run.version} promoted: {check}" + (f" on {used} ratings" if used else "") + vouched + \
                halfway + "; now answering with it"
        if run.state == "skipped":
            return f"· training run {run.id} trained nothing: {run.error or 'see rlfleet status'}; {self._next()}"
        if run.state == "stale":
            return f"✗ {run.version} set aside: a reset happened while it trained"
        if run.state == "rejected":
            what = f"{run.version} rejected"
        else:
            what = f"training run {run.id} " + ("stopped" if was_interrupted(run) else "failed")
        return f"✗ {what}: {run.error or 'see rlfleet status'}; {self._next()}"

    def _next(self) -> str:
        latest = self.store.latest_run(self.slug)
        if latest is not None and latest.state in ("queued", "running"):
            return "a new run is on its way"
        if self.store.training_paused(self.slug):
            return "ratings stay pending; automatic training is paused (/rl resume, or /rl train for a run now)"
        more = ratings_until_run(self.store, self.slug, self.threshold)
        if more == 0:
            return "ratings stay pending; it runs again when the training worker is back"
        return f"ratings stay pending, next run after {more} more"

    def about_trigger(self, note: str | None) -> str | None:
        """The trigger's note on a rating, or None where it would only repeat itself."""
        if note != TRAINING_BUSY:
            return note
        latest = self.store.latest_run(self.slug)
        run_id = latest.id if latest else None
        if run_id == self._busy_said:
            return None
        self._busy_said = run_id
        return note


def progress_line(tr: dict) -> str | None:
    p = tr.get("progress")
    if tr["state"] == "running" and p:
        rate = f" · {p['tokens_per_s']:.0f} tok/s" if p["tokens_per_s"] else ""
        return f"training {p.get('version') or ''}: {p['phase']} step {p['step']}/{p['total']}{rate}"
    if tr["state"] in ("queued", "running"):
        return "training queued" if tr["state"] == "queued" else "training: starting"
    return None
