"""What applying an event answers (``Applied``), and the words and column values both apply paths of
the store share (the ORM path in shared/store.py, the Core path in shared/fast_apply.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from .events import Capture, Rating

# What a rating is filed under for training: one lineage's name for every rating (the model's slug), or
# a function of the rating and its answer's conversation (scopes: Config.lineage_of).
TrainModel = str | Callable[[Rating, str | None], str]


def lineage_of(train_model: TrainModel, ev: Rating, conversation: str | None) -> str:
    return train_model if isinstance(train_model, str) else train_model(ev, conversation)


@dataclass(frozen=True)
class Applied:
    """What a job did, returned to whoever enqueued it (the CLI prints ``message``)."""

    ok: bool
    message: str
    duplicate: bool = False
    capture_id: str | None = None
    rating_id: int | None = None
    value: int | None = None
    train_model: str | None = None  # the lineage a new rating was filed under (shared/scopes.py)

    def answer(self) -> dict:
        """What the job answers whoever enqueued the event (the lineage is the worker's own business)."""
        return {k: v for k, v in asdict(self).items() if k != "train_model"}


def as_utc(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def capture_values(ev: Capture) -> dict:
    """The ``captures`` row of a capture event, column by column."""
    return {
        "id": ev.capture_id, "event_id": ev.event_id, "source": ev.source, "conversation": ev.conversation,
        "message_ref": ev.message_ref, "owner": ev.owner, "prompt": [m.model_dump() for m in ev.prompt],
        "response": ev.response, "model": ev.model, "adapter_version": ev.adapter_version,
        "behaviour_logprobs": ev.behaviour_logprobs, "behaviour_token_ids": ev.behaviour_token_ids,
        "finish_reason": ev.finish_reason, "created": as_utc(ev.ts),
    }


def rated(value: int, again: bool, response: str, stars: int | None = None) -> str:
    """The answer to a rating that was stored."""
    given = f" ({stars}★)" if stars else ""
    return f"{'re-rated' if again else 'rated'} {'good' if value > 0 else 'bad'}{given}: {preview(response)}"


def reasoned(value: int, reason: str | None) -> str:
    """The answer to a reason said after the rating (``/rl why``)."""
    return f"noted why it is {'good' if value > 0 else 'bad'}: {preview(reason or '')}"


def preview(text: str, n: int = 60) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


def kept_words(current: Any, value: int, comment: str | None, stars: int | None) -> tuple[str | None, int | None]:
    """The comment and stars of a rating ``value`` that replaces ``current`` (a row with ``value``,
    ``comment`` and ``stars``, or None): a second 👎 with no words (a button clicked again, a reaction
    after `/rl bad why`) keeps the words and stars the first one had; a change of thumb drops them."""
    if current is None or current.value != value:
        return comment, stars
    return (comment if comment is not None else current.comment), (stars if stars is not None else current.stars)
