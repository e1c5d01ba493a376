"""Simulated users: a hidden preference judged from the answer text alone.

A rater is ``(prompt: str, answer: str) -> 1 | -1 | None`` (None: no opinion, not rated). Named
ones are built from a spec, ``NAME`` or ``NAME:ARG`` (``short:30`` = under 30 words). Any
function of that shape plugs in with ``--rater FILE.py:FUNC``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Rater = Callable[[str, str], "int | None"]

_WORD = re.compile(r"[A-Za-z']+")
POLITE = ("please", "thank", "glad to help", "happy to help", "hope this helps", "you're welcome", "kindly")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Preference:
    name: str
    description: str
    rate: Rater


def short(limit: int = 30) -> Rater:
    return lambda _p, a: 1 if len(words(a)) < limit else -1


def question(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if a.rstrip().endswith("?") else -1


def topic(word: str = "ocean") -> Rater:
    w = word.lower()
    return lambda _p, a: 1 if w in words(a) else -1


def avoid(word: str = "however") -> Rater:
    w = word.lower()
    return lambda _p, a: -1 if w in words(a) else 1


def polite(_unused: str | None = None) -> Rater:
    return lambda _p, a: 1 if any(k in a.lower() for k in POLITE) else -1


_NAMED: dict[str, tuple[Callable[..., Rater], str, type | None]] = {
    "short": (short, "answers under N words (default 30)", int),
    "question": (question, "answers that end with a question", None),
    "topic": (topic, "answers that mention a given word (default 'ocean')", str),
    "avoid": (avoid, "answers that avoid a given word (default 'however')", str),
    "polite": (polite, "a polite register (please, thank you, glad to help, ...)", None),
}


CONTROLS = ("short:30", "question", "topic:ocean", "avoid:however", "polite")


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
    except ValueError:
        raise ValueError(f"bad argument {arg!r} for preference {name!r}") from None
    return Preference(spec, description + (f" [{arg}]" if arg else ""), rate)


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

    def rate(prompt: str, answer: str) -> int | None:
        value = fn(prompt, answer)
        if value not in (1, -1, None):
            raise ValueError(f"{spec} returned {value!r}; a rater returns 1, -1 or None")
        return value

    return Preference(f"{file.stem}:{func}", (fn.__doc__ or "external rater").strip().splitlines()[0], rate)
