"""Whose adapter a rating trains: the scope of a rating, and the lineage each scope keeps.

A **scope** is ``shared`` (one adapter for everyone: the default), ``person`` (each person who rates has
their own) or ``channel`` (each channel, group or team conversation has its own). Its **key** names one
of them: ``shared``, ``person:slack:U024BE7LH``, ``channel:discord:1180…``. Each key has its own
**lineage**: its ratings, pending count and threshold, runs, EMA baseline, versions and ``CURRENT``,
kept in the store and the registry under one name, :func:`lineage`: the model's slug for the shared
scope (so a data dir from before scopes is the shared scope as it was), ``slug@key`` for another.

Pure functions: what the ingress and the worker call to route a rating to its lineage
(docs/scopes.md).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

Scope = Literal["shared", "person", "channel"]
SCOPES: tuple[Scope, ...] = ("shared", "person", "channel")
SHARED = "shared"
_SEP = "@"
MAX_LINEAGE = 200  # the store keeps a lineage in 256-character columns
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def scope_key(scope: Scope, source: str, actor: str | None, conversation: str | None) -> str:
    """The key of the scope a rating by ``actor`` on ``source``, of an answer in ``conversation``,
    trains: a ``person`` scope is the one who rates (no one's rating trains someone else's adapter); a
    ``channel`` scope is the answer's conversation (a person's own when there is none). A sender the
    platform does not name has no person scope: the shared one."""
    if scope == "channel" and conversation:
        return f"channel:{source}:{conversation}"
    if scope in ("person", "channel") and actor:
        return f"person:{source}:{actor}"
    return SHARED


def parse_key(text: str, sources: tuple[str, ...]) -> str:
    """``text`` as a scope key (``shared``, ``person:<source>:<id>``, ``channel:<source>:<id>``, the
    source one of ``sources``), or ValueError saying what is wrong with it."""
    if text == SHARED:
        return text
    kind, _, rest = text.partition(":")
    source, _, ident = rest.partition(":")
    if kind not in ("person", "channel") or source not in sources or not ident:
        raise ValueError(f"{text[:80]!r} is not a scope: `shared`, `person:<source>:<id>` or `channel:<source>:<id>`, "
                         f"the source one of {', '.join(sources)}")
    if len(ident) > 256 or not ident.isprintable():
        raise ValueError("a scope's id is at most 256 printable characters")
    return text


def lineage(slug: str, key: str) -> str:
    """The name ``key``'s ratings, runs, baseline and versions are kept under for model ``slug``: the
    slug itself for the shared scope; ``slug@key`` otherwise, the key's id cut and suffixed with a hash
    where the whole would not fit the store's columns (the same key always gives the same name)."""
    if key == SHARED:
        return slug
    if _SEP in slug:
        raise ValueError(f"a model slug cannot hold {_SEP!r}: {slug!r}")
    name = f"{slug}{_SEP}{key}"
    if len(name) <= MAX_LINEAGE:
        return name
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{name[:MAX_LINEAGE - 17]}~{digest}"


def split(name: str) -> tuple[str, str]:
    """``(slug, key)`` of a lineage name (the key cut, for a long one, as :func:`lineage` cut it)."""
    slug, sep, key = name.partition(_SEP)
    return slug, key if sep else SHARED


def is_scoped(name: str) -> bool:
    return _SEP in name


def folder(name: str) -> Path:
    """Where a lineage's versions and ``CURRENT`` live under the adapters root: ``<slug>`` for the
    shared scope (as before scopes), ``<slug>@scopes/<key, file-safe>-<hash>`` for another."""
    slug, key = split(name)
    if key == SHARED:
        return Path(slug)
    safe = _SAFE.sub("_", key)[:80].strip("._") or "scope"
    return Path(f"{slug}{_SEP}scopes") / f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
