"""What the dashboard shows, as one JSON document: the status every front end shows (shared/status.py),
the versions as `rlfleet history` lists them, and the ratings over time. The bucketing is pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from rlfleet.shared.config import Config
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import QueueHandle
from rlfleet.shared.status import build_status
from rlfleet.shared.status_view import history_rows
from rlfleet.shared.store import RatingMark, Store

TIMELINE_HOURS = 48  # the ratings chart's span, in hourly bars


def timeline(marks: Sequence[RatingMark], now: datetime, hours: int = TIMELINE_HOURS) -> list[dict]:
    """One bar per hour for the last ``hours`` hours, oldest first: good and bad ratings made in it."""
    start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours - 1)
    good, bad = [0] * hours, [0] * hours
    for m in marks:
        i = int((m.created - start).total_seconds() // 3600)
        if 0 <= i < hours:
            (good if m.value > 0 else bad)[i] += 1
    return [{"hour": (start + timedelta(hours=i)).isoformat(), "good": good[i], "bad": bad[i]} for i in range(hours)]


def by_source(counts: Sequence[tuple[str, int, bool, int]]) -> list[dict]:
    """Good, bad and pending ratings per source (from ``Store.counts_by_source``), the busiest first."""
    good: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    pending: Counter[str] = Counter()
    for source, value, is_pending, n in counts:
        (good if value > 0 else bad)[source] += n
        if is_pending:
            pending[source] += n
    sources = sorted(set(good) | set(bad), key=lambda s: (-(good[s] + bad[s]), s))
    return [{"source": s, "good": good[s], "bad": bad[s], "pending": pending[s]} for s in sources]


def dashboard(cfg: Config, store: Store, handle: QueueHandle, now: datetime | None = None) -> dict[str, Any]:
    now = now or datetime.now(timezone.utc)
    slug = model_slug(cfg.model)
    status = build_status(cfg, store, handle.redis, slug)
    marks = store.rating_marks(slug, since=now - timedelta(hours=TIMELINE_HOURS))
    return {
        "status": status,
        "history": history_rows((status.get("adapter") or {}).get("versions") or []),
        "timeline": timeline(marks, now),
        "sources": by_source(store.counts_by_source(slug)),
        "now": now.isoformat(),
    }
