"""OpenAI's ``stop``: an answer ends before the first of a few strings, whole or streamed.

The engine stops drawing a row once its last token completes a stop string (:class:`StopCheck`), and
the answer is cut where that string begins: the text, and the tokens and log-probs whose text lies
before it (what a capture of the cut answer trains on). While an answer streams, text that may be the
start of a stop string is held back until the next piece says whether it is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

MAX_STOPS = 4  # as OpenAI allows
MAX_STOP_CHARS = 256


def earliest_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the answer ends: the start of the stop string completed first, as an engine that stops on
    one draws no further (of those completed by one character, the one begun first); None: there is none.
    A longer stop string begun earlier but completed later never counts: the answer had stopped."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many of ``text``'s last characters may begin a stop string the next piece completes."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopCheck:
    """Whether a row's new tokens so far complete one of its stop strings: asked after every token an
    engine draws, so only the text of the last few tokens is decoded (a stop string completed earlier
    would have stopped the row then). ``stops[row]``: that row's strings, empty for none."""

    def __init__(self, tokenizer: Any, stops: Sequence[Sequence[str]]) -> None:
        self.tokenizer, self.stops = tokenizer, [list(s) for s in stops]
        # Tokens enough to spell the longest string even a byte a token, and a few more so that the
        # decoded tail never begins inside it (a tail that starts mid-character decodes to U+FFFD).
        longest = max((len(x.encode("utf-8")) for row in self.stops for x in row), default=0)
        self.window = longest + 8

    def __bool__(self) -> bool:
        return any(self.stops)

    def __call__(self, row: int, ids: Sequence[int]) -> bool:
        stops = self.stops[row]
        if not stops:
            return False
        tail = self.tokenizer.decode(list(ids[-self.window:]), skip_special_tokens=True)
        return any(s in tail for s in stops)


def cut_answer(answer: Any, stops: Sequence[str], tokenizer: Any) -> Any:
    """``answer`` (shared.responder.Answer) ending before its first stop string, ``finish_reason``
    ``stop``; unchanged when it holds none. Its tokens are those whose text lies before the cut.
    The strings are looked for in the text as drawn: ``answer.text`` is stripped, and a drawing that
    stopped at a stop string of whitespace ("\n") ends in it."""
    drawn = tokenizer.decode(answer.token_ids, skip_special_tokens=True) if stops else ""
    at = earliest_stop(drawn, stops) if stops else None
    if at is None:
        return answer
    before = drawn[:at]
    kept = 0
    for k in range(1, len(answer.token_ids) + 1):
        piece = tokenizer.decode(answer.token_ids[:k], skip_special_tokens=True)
        if len(piece) > len(before):
            break
        # (a character drawn in several tokens decodes to "\ufffd" until its last one: not an end)
        if before.startswith(piece):
            kept = k
    return dataclasses.replace(answer, text=before.strip(), token_ids=answer.token_ids[:kept],
                               logprobs=answer.logprobs[:kept], new_tokens=kept, finish_reason="stop")


class StopFilter:
    """The pieces of a streamed answer as they may be sent: up to the first stop string, each piece's
    text held back while it may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        # What is not sent yet: text sent never ends in the start of a stop string (that much is held
        # back), so a stop string can only begin in here.
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """What of the answer so far can be sent now ("" for nothing yet, or after a stop)."""
        if self.stopped:
            return ""
        self.pending += piece
        at = earliest_stop(self.pending, self.stops)
        if at is not None:
            self.stopped = True
            out, self.pending = self.pending[:at], ""
            return out
        cut = len(self.pending) - held_back(self.pending, self.stops)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back rest, once the answer has ended without completing a stop string."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
