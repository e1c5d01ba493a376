"""Who may do what (DESIGN.md §4): one truth table for every ingress."""

from __future__ import annotations

from typing import Literal

Action = Literal["rate", "undo", "status", "train", "rollback", "promote", "reset"]
ADMIN_ACTIONS: frozenset[str] = frozenset({"train", "rollback", "promote", "reset"})
LOCAL_ACTOR = "local"  # the terminal user: always admin of their own data dir


def may_rate(
    actor: str, owner: str, raters: frozenset[str] = frozenset(), admins: frozenset[str] = frozenset()
) -> bool:
    """A rating counts only from the capture's owner or an allowlisted rater or admin."""
    return actor == owner or actor in raters or actor in admins


def may_command(action: str, actor: str, source: str, admins: frozenset[str] = frozenset()) -> bool:
    if action not in ADMIN_ACTIONS:
        return True
    if source == "cli" and actor == LOCAL_ACTOR:
        return True
    return actor in admins
