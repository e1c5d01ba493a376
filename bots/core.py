"""What every platform bot shares: a normalised command, reaction or button press -> permission check
-> typed event on the queue -> a short reply (or none).

A platform file (`bots/slack.py`, ...) only turns its SDK's objects into calls on :class:`BotCore`
and posts the replies back; the rules (who may rate what, admin cooldown, which messages count) live
here and in `shared/permissions.py`, once for all four platforms. The worker checks the same truth
table again when it applies an event, so a forged or stale event is refused there too.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from rlfleet.shared.config import BotSettings, Config
from rlfleet.shared.events import (
    Capture,
    Command,
    Message,
    Platform,
    Rating,
    Undo,
    describe_validation_error,
    well_formed,
)
from rlfleet.shared.models import model_slug
from rlfleet.shared.permissions import may_command, may_rate
from rlfleet.shared.posted import Posted, PostedMessages
from rlfleet.shared.queue import QueueHandle, enqueue_event, status_key, wait_for
from rlfleet.shared.store import Store

from .commands import HELP, RlCommand, parse_rl, status_line
from .completions import ChatCompletions, Completion

log = logging.getLogger(__name__)

ADMIN_COOLDOWN_S = 30
NOTHING_TO_RATE = "nothing of yours to rate here"
NOT_YOURS = "only the person the bot answered (or an allowlisted rater) can rate this answer"

F = TypeVar("F", bound=Callable[..., Any])


def _well_formed_args(method: F) -> F:
    """Every str argument through `well_formed`. An id or text from a platform's JSON may hold a lone
    surrogate, which no Redis key and no event takes (a reaction whose message id had one crashed the
    turn); doing it where the platform hands over keeps the ids compared later alike."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(well_formed(a) if isinstance(a, str) else a for a in args)
        kwargs = {k: well_formed(v) if isinstance(v, str) else v for k, v in kwargs.items()}
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Reply:
    text: str
    private: bool = True  # ephemeral where the platform has it, else to the sender only


class BotCore:
    """One platform's rules on top of the queue. Async, because three of the four SDKs are."""

    def __init__(
        self,
        source: Platform,
        cfg: Config,
        handle: QueueHandle,
        store: Store | None = None,
        responder: ChatCompletions | None = None,
        wait_s: float = 8.0,
    ) -> None:
        settings = cfg.bots.get(source)
        if settings is None:
            raise ValueError(f"unknown platform {source!r}")
        self.source: Platform = source
        self.cfg = cfg
        self.settings: BotSettings = settings
        self.allow = cfg.allowlists(source)
        self.handle = handle
        self.posted = PostedMessages(handle.redis, store)
        self.wait_s = wait_s
        self.slug = model_slug(cfg.model)
        self.responder = responder or ChatCompletions(cfg.responder, cfg.chat)

    # ---- who the bot talks to -------------------------------------------------------------------

    def answers_in(self, conversation: str, is_dm: bool) -> bool:
        """DMs and any channel it is in, unless `channels` names the only ones it answers in."""
        if not self.settings.channels:
            return True
        return conversation in self.settings.channels or (is_dm and "dm" in self.settings.channels)

    def may_rate(self, actor: str, owner: str) -> bool:
        return may_rate(actor, owner, self.allow.raters, self.allow.admins)

    # ---- answers ---------------------------------------------------------------------------------

    def prompt(self, context: list[tuple[bool, str]], text: str) -> list[dict]:
        """Chat messages for the responder: the last `context_messages` of the thread (``(by_bot, text)``,
        oldest first) and the new message. A lone surrogate becomes U+FFFD here, not a capture that
        fails after the answer is out."""
        keep = context[-self.settings.context_messages:] if self.settings.context_messages else []
        msgs = [{"role": "assistant" if by_bot else "user", "content": well_formed(t)} for by_bot, t in keep
                if t.strip()]
        return [*msgs, {"role": "user", "content": well_formed(text)}]

    async def answer(self, messages: list[dict]) -> Completion:
        return await self.responder.complete(messages)

    @_well_formed_args
    def seen(self, key: str, ttl_s: int = 3600) -> bool:
        """True when this platform delivery was handled already (platforms retry slow deliveries)."""
        return not self.handle.redis.set(f"rlfleet:seen:{self.source}:{key}", 1, nx=True, ex=ttl_s)

    @_well_formed_args
    def capture(
        self, conversation: str, message_ref: str, owner: str, prompt: list[dict], completion: Completion
    ) -> Capture:
        """Record an answer the bot has just posted as ``message_ref``: remembered for reactions at
        once, and enqueued as a `Capture` for the worker to store."""
        messages = completion.messages or prompt
        ev = Capture(
            source=self.source,
            actor=owner,
            conversation=conversation,
            message_ref=message_ref,
            owner=owner,
            prompt=[Message(role=m["role"], content=well_formed(m["content"])) for m in messages],
            response=well_formed(completion.text),  # a server may split a character's surrogates too
            model=self.cfg.model if completion.ours else completion.model,
            adapter_version=completion.adapter_version,
            behaviour_logprobs=completion.logprobs,
            behaviour_token_ids=completion.token_ids,
        )
        self.posted.remember(self.source, conversation, message_ref, ev.capture_id, owner)
        enqueue_event(self.handle, ev)
        return ev

    # ---- /rl ---------------------------------------------------------------------------------------

    @_well_formed_args
    async def command(
        self, actor: str | None, conversation: str, text: str, *, is_bot: bool = False, target: str | None = None
    ) -> Reply | None:
        """``/rl ...`` from ``actor`` in ``conversation``; ``target`` is the message ref of the answer
        it replies to, when the platform says (else good/bad address the actor's last answer here)."""
        if is_bot or not actor:
            return None
        try:
            return await self._command(actor, conversation, text, target)
        except ValidationError as exc:
            # What the platform handed us does not make an event (a NUL in the comment, a conversation or
            # user id over 256 characters): the ValidationError used to escape into the SDK's turn, and
            # the person got no reply at all.
            return Reply(describe_validation_error(exc, "could not record that"))

    async def _command(self, actor: str, conversation: str, text: str, target: str | None) -> Reply:
        cmd = parse_rl(text)
        if cmd.verb == "help":
            head = f"unknown command {cmd.unknown!r}. " if cmd.unknown else ""
            return Reply(head + HELP)
        if cmd.verb == "status":
            return Reply(status_line(self._snapshot()))
        if cmd.admin:
            return await self._admin(actor, cmd)
        if cmd.verb == "undo":
            return await self._send(Undo(source=self.source, actor=actor))
        posted = self.posted.lookup(self.source, conversation, target) if target else None
        if target and posted is None:
            return Reply(f"{NOTHING_TO_RATE}: that message is not an answer of this bot's")
        if posted is not None and not self.may_rate(actor, posted.owner):
            return Reply(NOT_YOURS)
        return await self._send(Rating(
            source=self.source, actor=actor, conversation=conversation,
            target=posted.capture_id if posted else "last",
            value=1 if cmd.verb == "good" else -1, comment=cmd.arg,
        ))

    async def _admin(self, actor: str, cmd: RlCommand) -> Reply:
        if not may_command(cmd.verb, actor, self.source, self.allow.admins):
            return Reply(f"/rl {cmd.verb} is for admins only")
        wait = self._cooldown(actor)
        if wait:
            return Reply(f"one admin command per {ADMIN_COOLDOWN_S} s: try again in {wait} s")
        args = {"version": cmd.arg} if cmd.verb == "rollback" and cmd.arg else {}
        return await self._send(Command(source=self.source, actor=actor, name=cmd.verb, args=args))

    def _cooldown(self, actor: str) -> int:
        """0 and start the cooldown, or the seconds left of a running one."""
        key = f"rlfleet:cooldown:{self.source}:{actor}"
        if self.handle.redis.set(key, 1, nx=True, ex=ADMIN_COOLDOWN_S):
            return 0
        return max(1, int(self.handle.redis.ttl(key)))

    # ---- reactions and buttons -----------------------------------------------------------------------

    def _rateable(self, actor: str | None, is_bot: bool, conversation: str, message_ref: str) -> Posted | None:
        if is_bot or not actor:
            return None
        posted = self.posted.lookup(self.source, conversation, message_ref)
        if posted is None or not self.may_rate(actor, posted.owner):
            return None
        return posted

    @_well_formed_args
    async def reaction(
        self,
        actor: str | None,
        conversation: str,
        message_ref: str,
        old: Literal[1, -1] | None,
        new: Literal[1, -1] | None,
        *,
        is_bot: bool = False,
    ) -> bool:
        """A thumbs reaction added (``new``), removed (``old`` only) or changed (both). Silent: True when
        it became an event, False when ignored (not ours, not theirs, a bot, not a thumb)."""
        if old == new:
            return False
        posted = self._rateable(actor, is_bot, conversation, message_ref)
        if posted is None:
            return False
        if new is not None:
            ev: Rating | Undo = Rating(source=self.source, actor=actor, conversation=conversation,
                                       target=posted.capture_id, value=new)
        else:
            ev = Undo(source=self.source, actor=actor, conversation=conversation, target=posted.capture_id,
                      value=old)
        enqueue_event(self.handle, ev)
        return True

    @_well_formed_args
    async def button(
        self, actor: str | None, conversation: str, message_ref: str, value: Literal[1, -1], *, is_bot: bool = False
    ) -> Reply | None:
        if is_bot or not actor:
            return None
        posted = self.posted.lookup(self.source, conversation, message_ref)
        if posted is None:
            return Reply(f"{NOTHING_TO_RATE}: that answer was not captured")
        if not self.may_rate(actor, posted.owner):
            return Reply(NOT_YOURS)
        return await self._send(Rating(source=self.source, actor=actor, conversation=conversation,
                                       target=posted.capture_id, value=value))

    # ---- plumbing ---------------------------------------------------------------------------------------

    async def _send(self, ev: Rating | Undo | Command) -> Reply:
        ticket = enqueue_event(self.handle, ev)
        result = await asyncio.to_thread(wait_for, ticket, self.wait_s)
        if result is None:
            return Reply("noted; it will be recorded when the rlfleet worker gets to it")
        msg = str(result.get("message") or ("done" if result.get("ok") else "failed"))
        if result.get("training"):
            msg += f" · {result['training']}"
        return Reply(msg)

    def _snapshot(self) -> dict | None:
        raw = self.handle.redis.get(status_key(self.slug))
        return json.loads(raw) if raw else None
