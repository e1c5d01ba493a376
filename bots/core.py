"""What the four platform bots share: one platform's settings bound to the ingress use cases
(`rlfleet.shared.ingress.usecases`), with the platform's own values (user ids, message refs, is-a-bot
flags) turned into those calls.

A platform file (`bots/slack.py`, ...) only turns its SDK's objects into calls on :class:`BotCore` and
posts the replies back. Who may do what is the permission table's (`shared/permissions.py`), asked once
per event by the use cases; the table follows config.toml while the bot runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from rlfleet.shared.config import BotSettings, Config
from rlfleet.shared.events import Capture, Platform, describe_validation_error, well_formed
from rlfleet.shared.ingress.reasons import reason_for
from rlfleet.shared.ingress.usecases import (
    ADMIN_COOLDOWN_S,
    Completion,
    PostAnswer,
    Reply,
    SayFailure,
    Turn,
    UseCases,
)
from rlfleet.shared.permissions import Actor, LiveTable
from rlfleet.shared.posted import PostedMessages
from rlfleet.shared.queue import QueueHandle
from rlfleet.shared.store import Store

from .completions import ChatCompletions

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


class BotCore:
    """One platform's bot on top of the use cases. Async, because three of the four SDKs are."""

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
        self.handle = handle
        self.posted = PostedMessages(handle.redis, store)
        self.responder = responder or ChatCompletions(cfg.responder, cfg.chat)
        self.cases = UseCases(
            LiveTable(cfg), cfg.model, handle, posted=self.posted, answerer=self.responder.complete,
            cooldown_s=ADMIN_COOLDOWN_S, context_messages=settings.context_messages, wait_s=wait_s,
            scope_of=lambda who, conversation: cfg.scope_key_of(who.source, who.id, conversation),
        )

    def who(self, actor: str | None, is_bot: bool = False) -> Actor:
        return Actor(self.source, actor, is_bot)

    # ---- who the bot talks to -------------------------------------------------------------------

    def answers_in(self, conversation: str, is_dm: bool) -> bool:
        """DMs and any channel it is in, unless `channels` names the only ones it answers in."""
        if not self.settings.channels:
            return True
        return conversation in self.settings.channels or (is_dm and "dm" in self.settings.channels)

    @_well_formed_args
    def seen(self, key: str, ttl_s: int = 3600) -> bool:
        """True when this platform delivery was handled already (platforms retry slow deliveries)."""
        return not self.handle.redis.set(f"rlfleet:seen:{self.source}:{key}", 1, nx=True, ex=ttl_s)

    # ---- answers ---------------------------------------------------------------------------------

    @_well_formed_args
    async def answer_and_capture(self, owner: str, conversation: str, text: str, post: PostAnswer,
                                 fail: SayFailure, context: Sequence[tuple[bool, str]] = ()) -> Capture | None:
        """Answer ``owner``'s message, ``post`` the answer (it returns the platform's message ref) and
        capture it; ``fail`` says why there is no answer."""
        turn = Turn(self.who(owner), conversation, text, context)
        return await self.cases.answer_and_capture(turn, post, fail)

    @_well_formed_args
    def capture(
        self, conversation: str, message_ref: str, owner: str, prompt: list[dict], completion: Completion
    ) -> Capture:
        """Record an answer the bot has just posted as ``message_ref``."""
        return self.cases.capture(self.who(owner), conversation, message_ref, prompt, completion)

    # ---- /rl, reactions and buttons ----------------------------------------------------------------

    @_well_formed_args
    async def command(
        self, actor: str | None, conversation: str, text: str, *, is_bot: bool = False, target: str | None = None
    ) -> Reply | None:
        """``/rl ...`` from ``actor`` in ``conversation``; ``target`` is the message ref of the answer
        it replies to, when the platform says (else good/bad address the actor's last answer here)."""
        try:
            return await self.cases.carry_out(self.cases.rl(self.who(actor, is_bot), conversation, text, target))
        except ValidationError as exc:
            # What the platform handed us does not make an event (a NUL in the comment, a conversation or
            # user id over 256 characters): a reply that says so, not an exception in the SDK's turn.
            return Reply(describe_validation_error(exc, "could not record that"))

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
        event = self.cases.react(self.who(actor, is_bot), conversation, message_ref, old, new)
        if event is None:
            return False
        self.cases.hand_over(event)
        return True

    @_well_formed_args
    async def button(
        self, actor: str | None, conversation: str, message_ref: str, value: Literal[1, -1], *, is_bot: bool = False,
        stars: int | None = None,
    ) -> Reply | None:
        """A good/bad button (or a star control: ``stars``, whose thumb ``value`` is) under an answer."""
        try:
            return await self.cases.carry_out(self.cases.press(self.who(actor, is_bot), conversation, message_ref,
                                                               value, stars))
        except ValidationError as exc:  # stars that disagree with the thumb, an id no event takes
            return Reply(describe_validation_error(exc, "could not record that"))

    @_well_formed_args
    async def reason(
        self, actor: str | None, conversation: str, message_ref: str, choice: str, *, is_bot: bool = False
    ) -> Reply | None:
        """A one-click reason (its number or words, shared/ingress/reasons.py) for the rating of the answer
        posted as ``message_ref``."""
        reason = reason_for(choice)
        if reason is None:
            return Reply(f"not a reason of the menu: {choice[:40]!r}; type /rl why <your words>")
        try:
            return await self.cases.carry_out(self.cases.why(self.who(actor, is_bot), conversation, reason,
                                                             reply_to=message_ref))
        except ValidationError as exc:  # an id the platform handed us that no event takes
            return Reply(describe_validation_error(exc, "could not record that"))
