"""The ingress use cases: answer and capture, rate, undo, command.

A front end turns what a person typed, reacted with or pressed into one of these calls, naming the
person as an :class:`~rlfleet.shared.permissions.Actor` it vouches for. Each call asks the permission
table once and makes at most one event. What comes back is an :data:`Outcome`: a :class:`Reply` to
show now, a :class:`Send` (an event, whose answer comes from the worker: :meth:`UseCases.carry_out`),
or None (nothing to say: a bot, a sender the platform does not name, a reaction that does not count).
The rules are plain calls; only `capture`, `answer_and_capture`, `hand_over` and `carry_out` touch
the queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import redis

from .. import scopes
from ..chat_prompt import without_earliest_turn
from ..errors import ContextTooLong, RlfleetError
from ..events import Capture, Command, FinishReason, Message, Rating, Source, Undo, well_formed
from ..inbox import Ticket
from ..models import model_slug
from ..permissions import Action, Actor, Decision, PermissionTable
from ..posted import Posted, PostedMessages
from ..queue import QueueHandle, enqueue_event, status_key, wait_for
from .grammar import HELP, parse_rl
from .replies import NOT_YOURS, NOTHING_TO_RATE, WHY_USAGE, admins_only, status_line, worker_answer

# The commands that act on the adapter of the scope they are said in (shared/scopes.py), and those of
# them a person may run on an adapter of their own (a `person` scope) without being an admin.
SCOPED_VERBS = frozenset({"status", "train", "rollback", "reset", "pause", "resume"})
OWN_SCOPE_VERBS = frozenset({"status", "train", "rollback", "reset"})

log = logging.getLogger(__name__)

ADMIN_COOLDOWN_S = 30
Value = Literal[1, -1]


@dataclass(frozen=True)
class Completion:
    """An answer a responder gave, as its capture records it."""

    text: str
    model: str
    adapter_version: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    messages: list[dict] | None = None  # the prompt as the server built it (system prompt added), if ours
    ours: bool = False  # answered by the model we train (`rlfleet serve`, the terminal's own model)
    finish_reason: FinishReason | None = None  # "length": a length cap cut it off; None: not known

    @classmethod
    def ours_from(cls, answer: Any, model: str) -> Completion:
        """What the local responder answered (``shared.responder.Answer``), with its behaviour log-probs."""
        return cls(text=answer.text, model=model, adapter_version=answer.adapter_version, token_ids=answer.token_ids,
                   logprobs=answer.logprobs, messages=answer.messages, ours=True, finish_reason=answer.finish_reason)


@dataclass(frozen=True)
class Reply:
    text: str
    private: bool = True  # ephemeral where the platform has it, else to the sender only
    # A 👎 just recorded without words: a front end with buttons offers the one-click reasons with it
    # (shared/ingress/reasons.py), each one `why` on the same answer.
    ask_why: bool = False
    recorded: bool = False  # the worker applied the event this answers (False: refused, or not yet known)


@dataclass(frozen=True)
class Send:
    """Hand ``event`` to the worker; the reply is its answer."""

    event: Rating | Undo | Command


Outcome = Reply | Send | None


@dataclass(frozen=True)
class Turn:
    """A message a front end decided to answer: from ``who``, in ``conversation``; ``context`` is the
    thread before it as ``(by the bot, text)``, oldest first."""

    who: Actor
    conversation: str
    text: str
    context: Sequence[tuple[bool, str]] = ()


# The responder of a front end: the prompt and the scope key whose adapter answers (shared/scopes.py;
# None: the shared one) -> the answer.
Answerer = Callable[[list[dict], str | None], Awaitable[Completion]]
PostAnswer = Callable[[str], Awaitable[str | None]]  # posts the answer's text; its message ref, if any
SayFailure = Callable[[str], Awaitable[None]]


def _named_scope(arg: str | None) -> tuple[str | None, str | None]:
    """``(scope key, the rest)`` when a command's argument starts with one (``person:…``, ``channel:…``,
    ``shared``), else ``(None, arg)``."""
    head, _, rest = (arg or "").partition(" ")
    if head == scopes.SHARED or head.startswith(("person:", "channel:")):
        return head, rest.strip() or None
    return None, arg


class UseCases:
    """The use cases of one front end. ``permissions`` is the table, or what returns the current one;
    ``posted`` knows which platform messages are answers it captured; ``cooldown_s`` spaces one person's
    admin commands; ``context_messages`` earlier thread messages go with a prompt."""

    def __init__(
        self,
        permissions: PermissionTable | Callable[[], PermissionTable],
        model: str,
        handle: QueueHandle | None = None,
        *,
        posted: PostedMessages | None = None,
        answerer: Answerer | None = None,
        cooldown_s: int | None = None,
        context_messages: int = 0,
        wait_s: float = 8.0,
        scope_of: Callable[[Actor, str], str | None] | None = None,
    ) -> None:
        self.table = permissions if callable(permissions) else (lambda: permissions)
        self.model = model
        self.slug = model_slug(model)
        self.handle = handle
        self.posted = posted
        self.answerer = answerer
        self.cooldown_s = cooldown_s
        self.context_messages = context_messages
        self.wait_s = wait_s
        self.scope_of = scope_of  # whose adapter answers someone in a conversation (None: the shared one)

    def decide(self, who: Actor, action: Action) -> Decision:
        return self.table().decide(who, action)

    # ---- answer and capture ------------------------------------------------------------------------

    def prompt(self, context: Sequence[tuple[bool, str]], text: str) -> list[dict]:
        """Chat messages for the responder: the last `context_messages` of the thread and the new
        message. A lone surrogate becomes U+FFFD here, not a capture that fails after the answer is out."""
        keep = context[-self.context_messages:] if self.context_messages else []
        msgs = [{"role": "assistant" if by_bot else "user", "content": well_formed(t)} for by_bot, t in keep
                if t.strip()]
        return [*msgs, {"role": "user", "content": well_formed(text)}]

    def capture_event(self, owner: Actor, conversation: str, prompt: list[dict], completion: Completion,
                      message_ref: str | None = None) -> Capture:
        """The capture of an answer given to ``owner``: the prompt as the model saw it (with any system
        prompt the responder added), so the trainer rebuilds the context its log-probs belong to."""
        messages = completion.messages or prompt
        return Capture(
            source=owner.source,
            actor=owner.id,
            conversation=conversation,
            message_ref=message_ref,
            owner=owner.id,
            prompt=[Message(role=m["role"], content=well_formed(m["content"])) for m in messages],
            response=well_formed(completion.text),  # a server may split a character's surrogates too
            model=self.model if completion.ours else completion.model,
            adapter_version=completion.adapter_version,
            behaviour_logprobs=completion.logprobs,
            behaviour_token_ids=completion.token_ids,
            finish_reason=completion.finish_reason,
        )

    def capture(self, owner: Actor, conversation: str, message_ref: str, prompt: list[dict],
                completion: Completion) -> Capture:
        """Record an answer just posted as ``message_ref``: known to reactions at once, and handed to the
        worker to store."""
        ev = self.capture_event(owner, conversation, prompt, completion, message_ref)
        if self.posted is not None:
            self.posted.remember(owner.source, conversation, message_ref, ev.capture_id, ev.owner)
        self.hand_over(ev)
        return ev

    async def answer_and_capture(self, turn: Turn, post: PostAnswer, fail: SayFailure) -> Capture | None:
        """Answer ``turn`` with the responder, ``post`` the answer, and capture it under the message ref
        the post returns. A responder that fails gets ``(no answer: why)`` said instead. A thread longer
        than the model reads at once is answered on its latest turns: the earliest go until it fits."""
        if self.answerer is None:
            raise RuntimeError("this front end has no responder")
        messages = self.prompt(turn.context, turn.text)
        try:
            scope = self.scope_of(turn.who, turn.conversation) if self.scope_of is not None else None
            while True:
                try:
                    completion = await self.answerer(messages, scope)
                    break
                except ContextTooLong:
                    shorter = without_earliest_turn(messages)
                    if shorter is None:
                        raise ContextTooLong("the message is longer than the model reads at once: shorten it "
                                             "or split it") from None
                    messages = shorter
        except RlfleetError as exc:
            log.warning("no answer: %s", exc)
            await fail(f"(no answer: {exc})")
            return None
        ref = await post(completion.text)
        if ref is None:
            return None
        return self.capture(turn.who, turn.conversation, well_formed(ref), messages, completion)

    # ---- rate, undo, command -----------------------------------------------------------------------

    def rl(self, who: Actor, conversation: str, text: str, reply_to: str | None = None) -> Outcome:
        """``/rl ...`` typed by ``who``; ``reply_to`` is the message ref of the answer it replies to, when
        the platform says (else good/bad address the actor's last answer here)."""
        cmd = parse_rl(text)
        verb = cmd.verb
        if verb == "good" or verb == "bad":
            return self.rate(who, conversation, 1 if verb == "good" else -1, cmd.arg, reply_to=reply_to,
                             stars=cmd.stars)
        if verb == "why":
            return self.why(who, conversation, cmd.arg, reply_to=reply_to)
        if verb == "undo":
            return self.undo(who)
        named, arg = _named_scope(cmd.arg) if verb in SCOPED_VERBS else (None, cmd.arg)
        if named is not None:  # `/rl reset person:slack:U123`: an admin acting on any scope's adapter
            try:
                key = scopes.parse_key(named, get_args(Source))
            except ValueError as exc:
                return Reply(str(exc))
            return self._on_scope(who, verb, key, arg, own=False, label=f"{key}'s adapter")
        scope = self.scope_of(who, conversation) if self.scope_of is not None and who.id is not None else None
        if scope is not None and scope != scopes.SHARED and verb in SCOPED_VERBS:
            # a person's own adapter is theirs to run; a channel's is everyone's there, so the admins'
            own = scope == scopes.scope_key("person", who.source, who.id, None) and verb in OWN_SCOPE_VERBS
            return self._on_scope(who, verb, scope, cmd.arg, own=own,
                                  label="your adapter" if own else "this channel's adapter")
        if verb == "help" or verb == "status":
            if not self.decide(who, verb).allowed:
                return None
            if verb == "status":
                return Reply(status_line(self.snapshot()))
            return Reply((f"unknown command {cmd.unknown!r}. " if cmd.unknown else "") + HELP)
        return self.command(who, verb, {"version": cmd.arg} if verb == "rollback" and cmd.arg else {})

    def _on_scope(self, who: Actor, verb: Action, key: str, arg: str | None, *, own: bool, label: str) -> Outcome:
        """``/rl <verb>`` on scope ``key``'s adapter (``arg``: rollback's version). ``own``: ``who``'s
        own adapter, theirs to run with no admin needed; else the admins' (``command``'s rules)."""
        if verb == "status":
            # on one's own adapter, whoever may rate may ask (a bot, or someone unheard, may not)
            if not self.decide(who, "rate" if own else "status").allowed:
                return None
            return Reply(f"{label}: " + status_line(self.snapshot(scopes.lineage(self.slug, key))))
        args: dict[str, Any] = {"scope": key, **({"version": arg} if verb == "rollback" and arg else {})}
        if not own:
            return self.command(who, verb, args)
        if not self.decide(who, "rate").allowed:
            return None
        wait = self._cooldown(who)
        if wait:
            return Reply(f"one command per {self.cooldown_s} s: try again in {wait} s")
        return Send(Command(source=who.source, actor=who.id, name=verb, args=args))

    def rate(self, who: Actor, conversation: str | None, value: Value, comment: str | None = None, *,
             reply_to: str | None = None, target: str = "last", event_id: str | None = None,
             stars: int | None = None) -> Outcome:
        """A rating of the answer ``reply_to`` names (a message this front end posted), else of ``target``
        (``last``, a capture id or a message ref), which the store resolves within the decision's scope;
        ``stars`` (1-5) beside the thumb when it was given in stars."""
        decision = self.decide(who, "rate")
        if not decision.allowed:
            return None
        if reply_to:
            return self._rate_posted(who, decision, conversation or "", reply_to, value, comment,
                                     "that message is not an answer of this bot's", stars)
        return Send(Rating(source=who.source, actor=who.id, conversation=conversation, target=target, value=value,
                           comment=comment, stars=stars, scope=decision.scope, **_event_id(event_id)))

    def why(self, who: Actor, conversation: str | None, reason: str | None, *, reply_to: str | None = None,
            target: str = "last", event_id: str | None = None) -> Outcome:
        """A reason said after the rating (``/rl why <reason>``): ``who``'s rating of the answer ``reply_to``
        names, else of ``target`` (``last``: their latest rating here), keeps its value and takes it."""
        decision = self.decide(who, "rate")
        if not decision.allowed:
            return None
        if not (reason or "").strip():
            return Reply(WHY_USAGE)
        if reply_to:
            return self._rate_posted(who, decision, conversation or "", reply_to, None, reason,
                                     "that message is not an answer of this bot's")
        return Send(Rating(source=who.source, actor=who.id, conversation=conversation, target=target, value=None,
                           comment=reason, scope=decision.scope, **_event_id(event_id)))

    def press(self, who: Actor, conversation: str, message_ref: str, value: Value, stars: int | None = None) -> Outcome:
        """A good/bad button under the answer ``message_ref``, or a star control (``stars``, whose thumb
        ``value`` is)."""
        decision = self.decide(who, "rate")
        if not decision.allowed:
            return None
        return self._rate_posted(who, decision, conversation, message_ref, value, None, "that answer was not captured",
                                 stars)

    def react(self, who: Actor, conversation: str, message_ref: str, old: Value | None,
              new: Value | None) -> Rating | Undo | None:
        """A thumbs reaction added (``new``), removed (``old`` only) or changed (both): the event it
        stands for, or None when it does not count (not ours, not theirs, a bot, not a change)."""
        if old == new:
            return None
        decision = self.decide(who, "rate")
        if not decision.allowed:
            return None
        posted = self._lookup(who, conversation, message_ref)
        if posted is None or not decision.reaches(posted.owner):
            return None
        if new is not None:
            return Rating(source=who.source, actor=who.id, conversation=conversation, target=posted.capture_id,
                          value=new, scope=decision.scope)
        return Undo(source=who.source, actor=who.id, conversation=conversation, target=posted.capture_id,
                    value=old)

    def undo(self, who: Actor, conversation: str | None = None, target: str | None = None,
             event_id: str | None = None) -> Outcome:
        """Take back ``who``'s latest rating (of ``target``, when given)."""
        if not self.decide(who, "undo").allowed:
            return None
        return Send(Undo(source=who.source, actor=who.id, conversation=conversation, target=target,
                         **_event_id(event_id)))

    def command(self, who: Actor, name: Action, args: dict[str, Any] | None = None,
                event_id: str | None = None) -> Outcome:
        """An admin command (train, rollback, promote, reset, pause, resume)."""
        decision = self.decide(who, name)
        if decision.refusal == "nobody":
            return None
        if not decision.allowed:
            return Reply(admins_only(name))
        wait = self._cooldown(who)
        if wait:
            return Reply(f"one admin command per {self.cooldown_s} s: try again in {wait} s")
        return Send(Command(source=who.source, actor=who.id, name=name, args=args or {}, **_event_id(event_id)))

    # ---- the queue -------------------------------------------------------------------------------------

    def hand_over(self, event: Capture | Rating | Undo | Command) -> Ticket:
        """Enqueue ``event`` without waiting for the worker; its ticket."""
        if self.handle is None:
            raise RuntimeError("this front end has no queue")
        return enqueue_event(self.handle, event)

    async def carry_out(self, outcome: Outcome) -> Reply | None:
        """Say a reply, or send an event and say the worker's answer (waiting up to ``wait_s``)."""
        if not isinstance(outcome, Send):
            return outcome
        ev = outcome.event
        ticket = self.hand_over(ev)
        result = await asyncio.to_thread(wait_for, ticket, self.wait_s)
        bare_thumbs_down = isinstance(ev, Rating) and ev.value == -1 and not ev.comment
        return Reply(worker_answer(result), ask_why=bare_thumbs_down and (result is None or bool(result.get("ok"))),
                     recorded=result is not None and bool(result.get("ok")))

    def snapshot(self, lineage: str | None = None) -> dict | None:
        """The worker's last published status (of one scope's ``lineage``), or None."""
        raw = self.handle.redis.get(status_key(lineage or self.slug)) if self.handle is not None else None
        return json.loads(raw) if raw else None

    # ---- helpers ---------------------------------------------------------------------------------------

    def _lookup(self, who: Actor, conversation: str, message_ref: str) -> Posted | None:
        return self.posted.lookup(who.source, conversation, message_ref) if self.posted is not None else None

    def _rate_posted(self, who: Actor, decision: Decision, conversation: str, message_ref: str,
                     value: Value | None, comment: str | None, not_ours: str, stars: int | None = None) -> Outcome:
        """A permitted rating of the answer this front end posted as ``message_ref``, if it is one and
        the decision reaches its owner."""
        posted = self._lookup(who, conversation, message_ref)
        if posted is None:
            return Reply(f"{NOTHING_TO_RATE}: {not_ours}")
        if not decision.reaches(posted.owner):
            return Reply(NOT_YOURS)
        return Send(Rating(source=who.source, actor=who.id, conversation=conversation, target=posted.capture_id,
                           value=value, comment=comment, stars=stars, scope=decision.scope))

    def _cooldown(self, who: Actor) -> int:
        """0 and start the cooldown, or the seconds left of a running one."""
        if not self.cooldown_s or self.handle is None:
            return 0
        conn: redis.Redis = self.handle.redis
        key = f"rlfleet:cooldown:{who.source}:{who.id}"
        if conn.set(key, 1, nx=True, ex=self.cooldown_s):
            return 0
        return max(1, int(conn.ttl(key)))


def _event_id(event_id: str | None) -> dict[str, str]:
    """The event id a sender chose (idempotency across its retries), else a new one."""
    return {"event_id": event_id} if event_id else {}

