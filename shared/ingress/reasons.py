"""The one-click reasons a front end offers under a 👎: the same few words everywhere, each one the
comment it stores (``/rl why`` takes any words; these are the ones a click gives)."""

from __future__ import annotations

REASONS: tuple[str, ...] = ("too long", "too short", "wrong", "off-topic", "tone")
OTHER = "other"  # the choice that asks for the person's own words


def reason_for(choice: str) -> str | None:
    """The reason a one-click choice stands for: its number (``"1"``) or its words; None for anything
    else (``other`` and free text are the front end's to ask for)."""
    choice = choice.strip().lower()
    if choice.isdigit() and 1 <= int(choice) <= len(REASONS):
        return REASONS[int(choice) - 1]
    return choice if choice in REASONS else None


def menu() -> str:
    """The choices as a terminal shows them: ``[1] too long  [2] too short …  [o] other``."""
    return "  ".join([f"[{i}] {r}" for i, r in enumerate(REASONS, 1)] + [f"[o] {OTHER}"])
