"""A conversation as the model's prompt: the one rendering the responder, llama.cpp, the trainers and
the gate share, so an answer is trained on the very tokens it was drawn after.

A conversation that ends with the user's (or system's) message asks for a new answer: the chat
template's generation prompt is added. One that ends with an assistant message is a *prefill*: the
answer continues that message (an agent's ``answer_prefix`` such as ``"Action:"``), so the template
renders it open, without its end token. The stored prompt keeps that last message, and every later
rendering continues it the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def continues(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the answer continues the conversation's last message (an assistant's prefill)."""
    return bool(messages) and messages[-1].get("role") == "assistant"


def without_earliest_turn(messages: Sequence[Mapping[str, Any]]) -> list[Any] | None:
    """``messages`` less their earliest turn, whole: the first message after the system prompt and the
    answers that follow it (a conversation goes on with what someone said). The last message always
    stays; None when nothing but it and the system prompt is left to drop."""
    first = next((i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"), None)
    if first is None:
        return None
    rest = [*messages[:first], *messages[first + 1:]]
    while first < len(rest) - 1 and rest[first].get("role") == "assistant":
        del rest[first]
    return rest


def token_ids(encoded: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template`` or a tokenizer returned (a list, a batch of one,
    or a dict/BatchEncoding of them, as transformers 5 returns)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # a batch of one
        encoded = encoded[0]
    return [int(i) for i in encoded]


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt's token ids: the generation prompt after a user's turn, the open last message after
    an assistant's prefill (whose content must not be blank: there is nothing to continue)."""
    messages = list(messages)
    if continues(messages):
        if not str(messages[-1].get("content") or "").strip():
            raise ValueError("an assistant message ending the prompt is a prefill: its content must not be blank")
        encoded = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    else:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return token_ids(encoded)
