"""Simulated users: a hidden preference judged from the answer text alone.

A rater is ``(prompt: str, answer: str) -> 1 | -1 | None`` (None: no opinion, not rated), or a pair
``(value, comment)``: the words a person adds to a rating (``/rl bad too long``), stored with it, or a
triple ``(value, comment, stars)`` with 1-5 stars that agree with the value (4-5 good, 1-3 bad: ``/rl 4``).
Named ones are built from a spec, ``NAME`` or ``NAME:ARG`` (``short:30`` = under 30 words) and say what
they want on a thumbs-down; ``short`` also grades in stars by length (``Preference.stars``, used with
``--stars``). Any function of these shapes plugs in with ``--rater FILE.py:FUNC``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlfleet.shared.events import MAX_COMMENT_CHARS
from rlfleet.shared.ingress.grammar import thumb_of

Rater = Callable[[str, str], "int | None | tuple[int | None, str | None]"]

_WORD = re.compile(r"[A-Za-z']+")
POLITE = ("please", "thank", "glad to help", "happy to help", "hope this helps", "you're welcome", "kindly")
# Phrases that introduce an example: unambiguous, unlike "such as" (a list) or "an example of" (a definition).
# The reader addressed: about 1 answer in 8 of the default model's does it on the held-out prompts.
_READER = frozenset({"you", "your", "yours", "yourself", "you're", "you've", "you'll", "you'd"})
_EXAMPLE = re.compile(r"\b(?:for example|for instance)\b|\be\.g\.", re.IGNORECASE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Judgement:
    value: int | None  # 1 liked, -1 disliked, None no opinion (not rated)
    comment: str | None = None  # what the user types after `/rl good|bad`
    stars: int | None = None  # 1-5, agreeing with value, when the rater grades (`/rl 4 comment`)


def judgement(result: object, who: str) -> Judgement:
    """A rater's return value, checked: ``1 | -1 | None``, ``(value, comment)`` or ``(value, comment,
    stars)``; ValueError says why not."""
    shape = ("a rater returns 1, -1 or None, or a pair (value, comment) with comment a str or None, or a "
             "triple (value, comment, stars)")
    stars: object = None
    if isinstance(result, tuple):
        if len(result) == 3:
            value, comment, stars = result
        elif len(result) == 2:
            value, comment = result
        else:
            raise ValueError(f"{who} returned {result!r}; {shape}")
    else:
        value, comment = result, None
    if value is not None and (isinstance(value, bool) or value not in (1, -1)):
        raise ValueError(f"{who} returned {result!r}; {shape}")
    if comment is not None:
        if not isinstance(comment, str):
            raise ValueError(f"{who} returned {result!r}; {shape}")
        if "\x00" in comment or len(comment) > MAX_COMMENT_CHARS:
            raise ValueError(f"{who} returned a comment with a NUL byte or over {MAX_COMMENT_CHARS} characters")
        comment = comment.strip() or None
    if value is None and comment is not None:
        raise ValueError(f"{who} returned a comment without a rating ({result!r}); comment with 1 or -1")
    if stars is not None:
        if isinstance(stars, bool) or not isinstance(stars, int) or not 1 <= stars <= 5:
            raise ValueError(f"{who} returned {result!r}; stars are 1 to 5")
        if value is None or thumb_of(stars) != value:
            raise ValueError(f"{who} returned {result!r}; {stars} stars are a thumbs-"
                             f"{'up' if thumb_of(stars) > 0 else 'down'} (4-5 up, 1-3 down)")
    return Judgement(None if value is None else int(value), comment, stars if isinstance(stars, int) else None)


@dataclass(frozen=True)
class Preference:
    name: str
    description: str
    rater: Rater
    stars: Callable[[str], int] | None = None  # the answer graded 1-5 (agreeing with the rater), where it grades

    def graded(self, prompt: str, answer: str) -> Judgement:
        """:meth:`judge`, with the stars of :attr:`stars` where the rater gave none."""
        j = self.judge(prompt, answer)
        if j.value is None or j.stars is not None or self.stars is None:
            return j
        return judgement((j.value, j.comment, self.stars(answer)), self.name)

    def judge(self, prompt: str, answer: str) -> Judgement:
        return judgement(self.rater(prompt, answer), self.name)

    def rate(self, prompt: str, answer: str) -> int | None:
        """The value alone (1, -1 or None): what held-out rates count."""
        return self.judge(prompt, answer).value


def short(limit: int = 30) -> Rater:
    return lambda _p, a: 1 if len(words(a)) < limit else (-1, f"too long, keep it under {limit} words")


def short_stars(limit: int = 30) -> Callable[[str], int]:
    """Stars by length, as someone who wants answers under ``limit`` words grades them: under half of it
    5, under it 4, then 3, 2 and 1 by each half-limit over."""
    def grade(answer: str) -> int:
        n = len(words(answer))
        if n < limit:
            return 5 if n < limit / 2 else 4
        return 3 if n < 1.5 * limit else 2 if n < 2 * limit else 1
    return grade


def question(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if a.rstrip().endswith("?") else (-1, "end with a question")


def topic(word: str = "ocean") -> Rater:
    w = word.lower()
    return lambda _p, a: 1 if w in words(a) else (-1, f"mention {word}")


def avoid(word: str = "however") -> Rater:
    w = word.lower()
    return lambda _p, a: (-1, f"don't say {word}") if w in words(a) else 1


def polite(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if any(k in a.lower() for k in POLITE) else (-1, "be more polite")


def example(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if _EXAMPLE.search(a) else (-1, "give an example")


def direct(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if _READER & set(words(a)) else (-1, "talk to me directly, say you")


_NAMED: dict[str, tuple[Callable[..., Rater], str, type | None]] = {
    "short": (short, "answers under N words (default 30)", int),
    "question": (question, "answers that end with a question", None),
    "topic": (topic, "answers that mention a given word (default 'ocean')", str),
    "avoid": (avoid, "answers that avoid a given word (default 'however')", str),
    "polite": (polite, "a polite register (please, thank you, glad to help, ...)", None),
    "example": (example, "answers that give an example ('for example', 'for instance', 'e.g.')", None),
    "direct": (direct, "answers that talk to the reader ('you', 'your', ...)", None),
}


# The named preferences that also grade an answer in stars (Preference.stars).
_GRADED: dict[str, Callable[..., Callable[[str], int]]] = {"short": short_stars}


CONTROLS = ("short:30", "question", "topic:ocean", "avoid:however", "polite", "example", "direct")


def controls() -> list[Preference]:
    """The named preferences a benchmark also scores every checkpoint by, whatever the user's taste."""
    return [preference(spec) for spec in CONTROLS]


def named() -> dict[str, str]:
    return {k: v[1] for k, v in _NAMED.items()}


def preference(spec: str) -> Preference:
    """``short``, ``short:20``, ``topic:ocean``, ... -> a Preference; ValueError names the choices."""
    name, _, arg = spec.partition(":")
    if name not in _NAMED:
        raise ValueError(f"unknown preference {name!r}; choose from {', '.join(_NAMED)} or use --rater FILE.py:FUNC")
    make, description, kind = _NAMED[name]
    if arg and kind is None:
        raise ValueError(f"preference {name!r} takes no argument")
    try:
        rate = make(kind(arg)) if arg else make()
        grade = None if name not in _GRADED else _GRADED[name](kind(arg)) if arg else _GRADED[name]()
    except ValueError:
        raise ValueError(f"bad argument {arg!r} for preference {name!r}") from None
    return Preference(spec, description + (f" [{arg}]" if arg else ""), rate, grade)


def load_rater(spec: str) -> Preference:
    """``path/to/file.py:func`` -> a Preference wrapping that function."""
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"--rater wants FILE.py:FUNC, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no such file {file}")
    module_spec = importlib.util.spec_from_file_location(f"rater_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"{file} has no function {func!r}")
    return Preference(f"{file.stem}:{func}", (fn.__doc__ or "external rater").strip().splitlines()[0], fn)
