"""The one `/rl` grammar, and the thumbs reactions: what people type and react with, as plain values.

Pure functions (standard library only) shared by every front end: the platform bots, the terminal chat
and the coding-agent hooks, so `/rl good` and 👍 mean the same thing everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Verb = Literal["good", "bad", "why", "undo", "status", "train", "rollback", "reset", "pause", "resume", "help"]
ADMIN_VERBS: frozenset[str] = frozenset({"train", "rollback", "reset", "pause", "resume"})
_VERBS: dict[str, Verb] = {
    "good": "good", "+": "good", "+1": "good", "up": "good",
    "bad": "bad", "-": "bad", "-1": "bad", "down": "bad", "why": "why", "because": "why",
    "undo": "undo", "status": "status", "train": "train", "rollback": "rollback", "reset": "reset",
    "pause": "pause", "resume": "resume",
    "help": "help", "?": "help",
}
MAX_COMMAND_CHARS = 2_000

HELP = (
    "/rl good [comment] · /rl bad [comment]: rate the bot's last answer to you here\n"
    "/rl 1-5 [comment]: rate it in stars (4-5 is a 👍, 1-3 a 👎)\n"
    "/rl why <reason>: say (or change) why, on your last rating here\n"
    "/rl undo: take back your last rating · /rl status: the model, ratings, training\n"
    "admins: /rl train · /rl rollback [version] · /rl reset (add a scope, person:slack:U123 or "
    "channel:slack:C123, to act on that adapter)\n"
    "admins: /rl pause · /rl resume: no training run starts by itself while paused (ratings are still kept, "
    "/rl train still runs)\n"
    "or react to an answer with 👍 / 👎 (remove the reaction to undo)"
)


@dataclass(frozen=True)
class RlCommand:
    verb: Verb
    arg: str | None = None  # the comment of good/bad, the reason of why, an admin verb's scope and version
    unknown: str | None = None  # what was typed when it was not a command we know
    stars: int | None = None  # a star rating (`/rl 4`): good or bad by the stars, with them

    @property
    def admin(self) -> bool:
        return self.verb in ADMIN_VERBS


_PREFIX = re.compile(r"^\s*/?rl(?:@\S+)?(?:\s+|$)", re.IGNORECASE)


def is_rl(text: str, slash_optional: bool = False) -> bool:
    """Whether a message is an `/rl` command rather than something for the model: it starts with ``/rl``
    (leading spaces aside). ``slash_optional`` also takes a bare ``rl`` and ``rl ...``, for front ends
    whose compose box keeps ``/`` for commands of its own (Teams)."""
    head = (text or "").lstrip().lower()
    return head.startswith("/rl") or (slash_optional and (head == "rl" or head.startswith("rl ")))


def parse_rl(text: str) -> RlCommand:
    """``"good nice one"`` or ``"/rl good nice one"`` (``/rl@botname`` too) -> a command; anything we
    do not know -> ``help`` with ``unknown`` set, so the reply can say what was not understood."""
    text = _PREFIX.sub("", text or "", count=1).strip()
    if not text:
        return RlCommand("help")
    if len(text) > MAX_COMMAND_CHARS:
        return RlCommand("help", unknown=text[:40] + "…")
    head, _, rest = text.partition(" ")
    verb = _VERBS.get(head.lower())
    arg = rest.strip() or None
    stars = stars_of(head)
    if stars is not None:
        return RlCommand("good" if thumb_of(stars) > 0 else "bad", arg, stars=stars)
    if verb is None:
        return RlCommand("help", unknown=head[:40])
    if verb in ("good", "bad", "why", "status") or verb in ADMIN_VERBS:  # status, admin verbs: a scope, a version
        return RlCommand(verb, arg)
    return RlCommand(verb)


MIN_LIKED_STARS = 4  # a star rating from here up is a 👍, below it a 👎
_STARS = re.compile(r"^([1-5])(?:/5|\*|★)?$")


def thumb_of(stars: int) -> Literal[1, -1]:
    """The thumb a star rating carries: 4 or 5 stars 👍, 1 to 3 👎 (an answer rated under 4 was not what
    the person wanted)."""
    return 1 if stars >= MIN_LIKED_STARS else -1


def stars_of(word: str) -> int | None:
    """``4``, ``4/5``, ``4*``, ``4★`` or ``★★★★`` -> 4; anything else (``+1`` is a thumb) -> None."""
    word = word.strip()
    if word and set(word) == {"★"} and len(word) <= 5:
        return len(word)
    match = _STARS.match(word)
    return int(match.group(1)) if match else None


_GOOD = {"+1", "thumbsup", "thumbs_up", "like", "👍", "1f44d_thumbsup"}
_BAD = {"-1", "thumbsdown", "thumbs_down", "👎", "1f44e_thumbsdown"}
# Skin tones: Slack "+1::skin-tone-3", Unicode U+1F3FB..U+1F3FF after the emoji, Teams "1f44d_thumbsup_3"-style.
_SKIN = re.compile(r"(::skin-tone-\d|[\U0001F3FB-\U0001F3FF]|\ufe0f|_\d+|_tone\d)+$")


def reaction_value(name: str | None) -> Literal[1, -1] | None:
    """+1 for a thumbs-up in any platform's spelling and skin tone, -1 for a thumbs-down, else None."""
    if not name:
        return None
    key = _SKIN.sub("", name.strip().strip(":").lower())
    if key in _GOOD or key.startswith("1f44d_thumbsup"):  # Teams appends tone and variant suffixes
        return 1
    if key in _BAD or key.startswith("1f44e_thumbsdown"):
        return -1
    return None
