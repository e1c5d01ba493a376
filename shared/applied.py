"""What applying an event answers (``Applied``), and the words and column values both apply paths of
the store share (the ORM path in shared/store.py, the Core path in shared/fast_apply.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from .events import Capture


@dataclass(frozen=True)
class Applied:
    """What a job did, returned to whoever enqueued it (the CLI prints ``message``)."""

    ok: bool
    message: str
    duplicate: bool = False
    capture_id: str | None = None
    rating_id: int | None = None
    value: int | None = None


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
