"""Typed events: the only thing that crosses the queue (DESIGN.md §3).

Every ingress (CLI, chat, bots, bridge) builds one of these and enqueues its JSON; the worker
parses it back with :func:`parse_event`. Validation happens here, at the edge, so nothing
malformed ever reaches the queue or the store.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from .errors import BadInput
from .ingress.grammar import thumb_of

# "gym": an agent's steps in an environment (rlfleet.gym), each rated by the environment's reward
Source = Literal["slack", "discord", "telegram", "teams", "cli", "web", "claude-code", "codex", "bridge", "gym"]
Platform = Literal["slack", "discord", "telegram", "teams"]
PLATFORMS: tuple[str, ...] = ("slack", "discord", "telegram", "teams")  # the chat platforms with bots

# Limits chosen so a pasted log fits but a runaway payload (or a 10 MB prompt) is refused at the edge.
MAX_TEXT_CHARS = 200_000
MAX_MESSAGES = 200
MAX_PROMPT_CHARS = 400_000
MAX_COMMENT_CHARS = 2_000
MAX_ID_CHARS = 256
MAX_LOGPROBS = 16_384

# How an answer ended: "stop", the model ended it (an end token, a stop sequence, a tool call);
# "length", a length cap cut it off. It decides whether the answer trains with an end token after it
# (docs/objective.md): a cut-off answer a user liked must not teach stopping mid-sentence.
FinishReason = Literal["stop", "length"]
# Each API's own word for it (OpenAI chat `finish_reason`, Anthropic `stop_reason`, OpenAI Responses
# `incomplete_details.reason`). None: a known word that says neither (a content filter cut it).
FINISH_WORDS: dict[str, FinishReason | None] = {
    "stop": "stop", "end_turn": "stop", "stop_sequence": "stop", "tool_calls": "stop", "tool_use": "stop",
    "function_call": "stop", "pause_turn": "stop",
    "length": "length", "max_tokens": "length", "max_output_tokens": "length",
    "content_filter": None, "refusal": None,
}


def finish_reason(word: object) -> FinishReason | None:
    """What an API's finish word says of how its answer ended; None for a missing or unknown one
    (nothing is known, so the answer trains as ended). For a server's reply, which must not fail over it."""
    return FINISH_WORDS.get(word) if isinstance(word, str) else None


def known_finish_word(word: str) -> str:
    """``word``, when it is one :data:`FINISH_WORDS` knows; a caller's typo is an error, not an unknown."""
    if word not in FINISH_WORDS:
        raise ValueError(f"finish_reason {word[:40]!r} is not one of {', '.join(FINISH_WORDS)}")
    return word


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _uuid() -> str:
    return str(uuid.uuid4())


def well_formed(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD. A platform's JSON may carry an escape like
    "\\ud800" that decodes to one; such text can be neither stored nor sent on as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _check_text(value: str, what: str, limit: int = MAX_TEXT_CHARS) -> str:
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL byte")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value):,} characters; the limit is {limit:,}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates from a bad decode
        raise ValueError(f"{what} is not valid UTF-8") from exc
    return value


Ident = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content(cls, v: str) -> str:
        return _check_text(v, "message content")


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    event_id: Ident = Field(default_factory=_uuid)
    source: Source = "cli"
    actor: Ident = "local"
    ts: datetime = Field(default_factory=_now)


class Capture(_Event):
    """An answer someone was given, kept so it can be rated later."""

    type: Literal["capture"] = "capture"
    capture_id: Ident = Field(default_factory=_uuid)
    conversation: Ident = "default"
    message_ref: Ident | None = None
    owner: Ident = "local"
    prompt: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    response: str
    model: Ident
    adapter_version: Ident | None = None
    behaviour_logprobs: list[float] | None = Field(default=None, max_length=MAX_LOGPROBS)
    behaviour_token_ids: list[int] | None = Field(default=None, max_length=MAX_LOGPROBS)
    finish_reason: FinishReason | None = None  # None: not known (an older capture, an agent's hook)

    @field_validator("capture_id", "message_ref")
    @classmethod
    def _not_last(cls, v: str | None) -> str | None:
        if v == "last":  # a rating's target "last" means the latest answer: one of this name could not be rated
            raise ValueError("'last' is reserved (a rating's target `last` is the latest answer): pick another id")
        return v

    @field_validator("response")
    @classmethod
    def _response(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("response is empty")
        return _check_text(v, "response")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: list[Message]) -> list[Message]:
        total = sum(len(m.content) for m in v)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {total:,} characters; the limit is {MAX_PROMPT_CHARS:,}")
        if not any(m.role == "user" and m.content.strip() for m in v):
            raise ValueError("prompt has no non-empty user message")
        return v


class Rating(_Event):
    """+1 / -1 on a capture, addressed by message ref or ``last`` in a conversation. ``scope`` is what the
    ingress's permission decision granted (shared/permissions.py): the actor's ``own`` answers only, or
    ``any`` one (an allowlisted rater); the store resolves the target within it. ``value`` None is a
    reason said afterwards (``/rl why``): the actor's rating of the answer keeps its value and takes
    ``comment`` as its reason. ``stars`` (1-5, ``/rl 4``) is stored beside the thumb, which it sets when
    none is given (:func:`thumb_of`) and must agree with when one is."""

    type: Literal["rating"] = "rating"
    target: Ident = "last"
    conversation: Ident | None = None
    value: Literal[1, -1] | None
    comment: str | None = None
    stars: int | None = Field(default=None, ge=1, le=5)
    # An environment's reward on an agent's step (source gym only): the thumb is the sign of the
    # step's return, and the rating trains only in its agent's runs (worker/gym/agent.py).
    reward: float | None = Field(default=None, allow_inf_nan=False)
    scope: Literal["own", "any"] = "own"

    @model_validator(mode="before")
    @classmethod
    def _stars_set_the_thumb(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("stars") is not None and data.get("value") is None:
            stars = data["stars"]
            if isinstance(stars, int) and not isinstance(stars, bool) and 1 <= stars <= 5:
                return {**data, "value": thumb_of(stars)}
        return data

    @field_validator("comment")
    @classmethod
    def _comment(cls, v: str | None) -> str | None:
        return None if v is None else _check_text(v, "comment", MAX_COMMENT_CHARS)

    @model_validator(mode="after")
    def _a_reason_has_words(self) -> Rating:
        if self.value is None and not (self.comment or "").strip():
            raise ValueError("a reason without a rating needs words: /rl why <reason>")
        if self.reward is not None and (self.source != "gym" or self.value is None):
            raise ValueError("a reward is an environment's, on an agent's rated step (source gym)")
        if self.stars is not None and self.value != thumb_of(self.stars):
            word = "up" if thumb_of(self.stars) > 0 else "down"
            raise ValueError(f"{self.stars} stars is a thumbs-{word} (4-5 up, 1-3 down); value {self.value} "
                             "contradicts it")
        return self


class Undo(_Event):
    """Removes the actor's most recent rating; with ``target``, their rating of that capture (only if it
    still has ``value``, when given: a removed 👍 does not undo the 👎 that replaced it)."""

    type: Literal["undo"] = "undo"
    target: Ident | None = None
    conversation: Ident | None = None
    value: Literal[1, -1] | None = None


CommandName = Literal["status", "train", "rollback", "promote", "reset", "pause", "resume"]


# What each command reads from its ``args`` and of which type (an argument it does not read is refused:
# a typo'd `force` must not quietly promote without it).
COMMAND_ARGS: dict[str, dict[str, tuple[type, ...]]] = {
    "status": {"scope": (str,)}, "train": {"scope": (str,)}, "pause": {"scope": (str,)},
    "resume": {"scope": (str,)}, "rollback": {"scope": (str,), "version": (str, int)},
    "promote": {"scope": (str,), "version": (str, int), "force": (bool,)},
    "reset": {"scope": (str,), "purge_ratings": (bool,)},
}


def check_command_args(name: str, args: dict[str, Any]) -> None:
    """ValueError with one line when ``args`` holds what command ``name`` does not read, or a value of
    the wrong type (None stands for left out)."""
    takes = COMMAND_ARGS.get(name, {})
    for key, value in args.items():
        if key not in takes:
            known = ", ".join(takes) or "none"
            raise ValueError(f"{name} takes no argument {_field_name(key)} (it takes: {known})")
        if value is not None and (not isinstance(value, takes[key]) or isinstance(value, bool) != (bool in takes[key])):
            kinds = " or ".join({"str": "a string", "int": "a number", "bool": "true or false"}[t.__name__]
                                for t in takes[key])
            raise ValueError(f"{name}'s {key} must be {kinds}")


class Command(_Event):
    type: Literal["command"] = "command"
    name: CommandName
    args: dict[str, str | int | bool | None] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _known_args(self) -> Command:
        check_command_args(self.name, self.args)
        return self


Event = Annotated[Capture | Rating | Undo | Command, Field(discriminator="type")]
_adapter: TypeAdapter[Capture | Rating | Undo | Command] = TypeAdapter(Event)


def parse_event(raw: str | bytes | dict) -> Capture | Rating | Undo | Command:
    """Parse and validate an event from JSON (or a dict); raise :class:`BadInput` with one clear line."""
    try:
        if isinstance(raw, dict):
            return _adapter.validate_python(raw)
        return _adapter.validate_json(raw)
    except ValidationError as exc:
        raise BadInput(describe_validation_error(exc)) from None


def _field_name(part: object, limit: int = 40) -> str:
    """One part of an error's location as a short printable token: a field name the sender made up may
    hold a newline or run for pages, and the error is one line."""
    text = str(part)
    if text.isprintable() and len(text) <= limit:
        return text
    return ascii(text[:limit]) + ("…" if len(text) > limit else "")


def describe_validation_error(exc: ValidationError, prefix: str = "invalid event") -> str:
    first = exc.errors()[0]
    where = ".".join(_field_name(p) for p in first.get("loc", ()))
    msg = " ".join(first.get("msg", "invalid").split())
    msg = msg.removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{prefix}: {where}: {msg}{more}" if where else f"{prefix}: {msg}{more}"
