"""``rlfleet capture``, ``good``, ``bad``, ``rate``, ``why`` and ``undo``: answers produced elsewhere, and their
ratings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import (
    FINISH_WORDS,
    Capture,
    Message,
    Rating,
    Undo,
    describe_validation_error,
    known_finish_word,
)
from rlfleet.shared.queue import queue_for

from .app import JsonOpt, app, command_config, dispatch, emit, out


def _read_text(value: str) -> str:
    """``@file`` reads a file, ``-`` reads stdin: long answers don't have to fit in an argument."""
    if value == "-":
        data = sys.stdin.buffer.read()
    elif value.startswith("@"):
        try:
            data = Path(value[1:]).read_bytes()
        except OSError as exc:
            raise BadInput(f"cannot read {value[1:]}: {exc.strerror}") from None
    else:
        return value
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("input is not valid UTF-8") from None


@app.command()
def capture(
    prompt: Annotated[str, typer.Option(help="The user's message (or @file, or - for stdin).")],
    response: Annotated[str, typer.Option(help="The answer that was given (or @file, or -).")],
    conversation: Annotated[str, typer.Option(help="Conversation or session id.")] = "default",
    message_ref: Annotated[str | None, typer.Option(help="Your id for this answer, to rate it by later.")] = None,
    source: Annotated[str, typer.Option(help="Where it came from (cli, claude-code, codex, bridge…).")] = "cli",
    model: Annotated[str, typer.Option(help="What produced the answer.")] = "external",
    finish_reason: Annotated[str | None, typer.Option(
        help="How the answer ended, in its API's word: stop, length (OpenAI), end_turn, max_tokens (Anthropic)…; "
             "one cut off by a length cap trains without an end token.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Record an answer produced elsewhere so it can be rated; prints the capture id."""
    if prompt == "-" and response == "-":
        raise BadInput("only one of --prompt and --response can be - (stdin): give the other as text or @file")
    try:
        ended = None if finish_reason is None else FINISH_WORDS[known_finish_word(finish_reason)]
        ev = Capture(
            source=source, conversation=conversation, message_ref=message_ref,
            prompt=[Message(role="user", content=_read_text(prompt))], response=_read_text(response), model=model,
            finish_reason=ended,
        )
    except Exception as exc:
        raise BadInput(_validation_line(exc)) from None
    cfg = command_config()  # after the checks: bad input makes no data dir
    with queue_for(cfg) as q:
        result = dispatch(q, cfg, ev)
    if as_json:
        emit(result, True)
    elif result.get("ok"):
        out.print(result.get("capture_id") or ev.capture_id)
    else:
        emit(result, False)


def _rate(value: int | None, target: str, comment: str | None, conversation: str | None, as_json: bool,
          stars: int | None = None, words: list[str] | None = None) -> None:
    if words and comment is not None:
        raise BadInput("say why once: in words after the command or with --comment, not both")
    cfg = command_config()
    try:
        ev = Rating(target=target, value=value, comment=" ".join(words) if words else comment,
                    conversation=conversation, stars=stars)
    except Exception as exc:
        raise BadInput(_validation_line(exc)) from None
    with queue_for(cfg) as q:
        result = dispatch(q, cfg, ev)
    emit(result, as_json)


TargetOpt = Annotated[str, typer.Option("--target", help="A capture id or message ref, or 'last'.")]
CommentOpt = Annotated[str | None, typer.Option("--comment", help="Why (kept with the rating).")]
ConvOpt = Annotated[str | None, typer.Option("--conversation", help="With --target last: in this conversation.")]
WhyArg = Annotated[list[str] | None, typer.Argument(
    help="Why, in your own words, as in the chat's `/rl bad too long` (the same as --comment).", show_default=False)]


@app.command()
def good(why: WhyArg = None, target: TargetOpt = "last", comment: CommentOpt = None, conversation: ConvOpt = None,
         as_json: JsonOpt = False) -> None:
    """Rate an answer good (the last one by default), with why in a few words if you like."""
    _rate(1, target, comment, conversation, as_json, words=why)


@app.command()
def bad(why: WhyArg = None, target: TargetOpt = "last", comment: CommentOpt = None, conversation: ConvOpt = None,
        as_json: JsonOpt = False) -> None:
    """Rate an answer bad (the last one by default), with why in a few words if you like."""
    _rate(-1, target, comment, conversation, as_json, words=why)


@app.command()
def rate(
    stars: Annotated[int, typer.Argument(min=1, max=5, help="1-5 stars: 4 or 5 is a good rating, 1 to 3 a bad one.")],
    why: WhyArg = None, target: TargetOpt = "last", comment: CommentOpt = None, conversation: ConvOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rate an answer in stars (the last one by default); the stars are kept beside the thumb they make, and a
    4 weighs more than a bare good, a 5 more still, against what you usually give (docs/objective.md)."""
    _rate(None, target, comment, conversation, as_json, stars, words=why)


@app.command()
def why(
    reason: Annotated[str, typer.Argument(help="Why you rated it so, e.g. 'too long' (or @file, or -).")],
    target: Annotated[str, typer.Option("--target", help="A capture id or message ref, or 'last' (the answer "
                                        "of your latest rating).")] = "last",
    conversation: ConvOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Say (or change) why you rated an answer as you did: the rating keeps its value and takes the reason."""
    cfg = command_config(must_exist=True)
    try:
        ev = Rating(target=target, value=None, comment=_read_text(reason), conversation=conversation)
    except Exception as exc:
        raise BadInput(_validation_line(exc)) from None
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, ev), as_json)


@app.command()
def undo(as_json: JsonOpt = False) -> None:
    """Take back your most recent rating."""
    cfg = command_config(must_exist=True)
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, Undo()), as_json)


def _validation_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    return str(exc).splitlines()[0]
