"""Who may do what: the one truth table for every ingress (docs/ingress.md).

An ingress asks :meth:`PermissionTable.decide` once for each thing a person does, and only what the
table permits becomes an event; the worker and the store apply events and decide nothing. The ingress
is where an identity is known for sure (a platform's signed payload, a bridge key's HMAC, the local
user of the data dir), and where the answer must come at once: a stranger's 👍 is ignored without a
trace, a non-admin's ``/rl train`` is refused before it could start a cooldown.

=================  ==========================================  ==============================
source             rate (``scope``: whose answers)              train, rollback, promote, reset,
                                                                pause, resume
=================  ==========================================  ==============================
a chat platform    everyone their own; its ``raters`` and       its ``admins``
                   ``admins`` anyone's (``any``)
``cli``            the local user their own                     the local user (``local``)
bridge, agents     the actor their own                          admin keys (``local`` always)
=================  ==========================================  ==============================

``status``, ``help`` and ``undo`` (which only ever takes back the actor's own rating) are everyone's.
Bots and senders the platform does not name count for nothing. A rating whose answer the ingress
cannot see (``last``, or a capture id sent to the bridge) carries its ``scope`` in the event, and the
store resolves its target within it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .config import Config, load_config
from .errors import ConfigError
from .events import PLATFORMS

log = logging.getLogger(__name__)

Action = Literal["help", "status", "rate", "undo", "train", "rollback", "promote", "reset", "pause", "resume"]
ADMIN_ACTIONS: frozenset[str] = frozenset({"train", "rollback", "promote", "reset", "pause", "resume"})
Scope = Literal["own", "any"]  # whose answers a rating may address: the actor's own, or anyone's
Refusal = Literal["nobody", "admins-only"]
LOCAL_ACTOR = "local"  # the terminal user, and the bridge key of the data dir's secret file
AGENT_SOURCES: tuple[str, ...] = ("bridge", "claude-code", "codex")  # what the bridge's keys act as


@dataclass(frozen=True)
class Actor:
    """Who did something, as the ingress knows them: a platform's own user id, ``local``, a bridge key's
    id (or a gateway's user, for data events). ``id`` None: a sender the platform does not name."""

    source: str
    id: str | None
    is_bot: bool = False


@dataclass(frozen=True)
class Grants:
    """On one source, who counts beyond the owner of an answer."""

    raters: frozenset[str] = frozenset()  # may rate anyone's answers
    admins: frozenset[str] = frozenset()  # may run the admin commands


@dataclass(frozen=True)
class Decision:
    allowed: bool
    refusal: Refusal | None = None
    scope: Scope = "own"
    actor: str | None = None

    def reaches(self, owner: str) -> bool:
        """Whether a permitted rating may address an answer given to ``owner``."""
        return self.allowed and (self.scope == "any" or owner == self.actor)


@dataclass(frozen=True)
class PermissionTable:
    grants: Mapping[str, Grants] = field(default_factory=dict)

    def decide(self, who: Actor, action: Action) -> Decision:
        if who.is_bot or not who.id:
            return Decision(False, "nobody")
        g = self.grants.get(who.source, Grants())
        if action in ADMIN_ACTIONS:
            return Decision(True, actor=who.id) if who.id in g.admins else Decision(False, "admins-only",
                                                                                 actor=who.id)
        scope: Scope = "any" if action == "rate" and who.id in g.raters else "own"
        return Decision(True, scope=scope, actor=who.id)

    @classmethod
    def for_config(cls, cfg: Config, admin_keys: Iterable[str] | None = None) -> PermissionTable:
        """The table ``cfg`` describes. ``admin_keys``: the bridge's admin key ids (default: ``local`` and
        the configured keys marked admin)."""
        grants: dict[str, Grants] = {}
        for platform in PLATFORMS:
            lists = cfg.allowlists(platform)
            grants[platform] = Grants(raters=lists.raters | lists.admins, admins=lists.admins)
        grants["cli"] = grants["web"] = Grants(admins=frozenset({LOCAL_ACTOR}))  # the data dir's owner
        if admin_keys is None:
            admin_keys = [k.id for k in cfg.bridge.keys if k.admin]
        bridge = Grants(admins=frozenset({LOCAL_ACTOR, *admin_keys}))
        grants.update({source: bridge for source in AGENT_SOURCES})
        return cls(grants)


class LiveTable:
    """The table of a config, read again from its config.toml whenever that file changes, so an admin
    or rater added or removed there counts at once, without restarting the bots (the worker reloads its
    config the same way). A config.toml that does not load keeps the last table, with a warning."""

    def __init__(self, cfg: Config) -> None:
        self.home, self.path = cfg.home, cfg.config_path
        self.mtime = _mtime(self.path)
        self.table = PermissionTable.for_config(cfg)

    def __call__(self) -> PermissionTable:
        mtime = _mtime(self.path)
        if mtime != self.mtime:
            self.mtime = mtime
            try:
                self.table = PermissionTable.for_config(load_config(self.home))
            except ConfigError as exc:
                log.warning("permissions unchanged: %s", exc)
        return self.table


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
