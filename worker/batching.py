"""Rated samples to token tensors: chat-template encoding, truncation, length-bucketed micro-batches."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

import torch

from rlfleet.shared.chat_prompt import prompt_ids, token_ids

from .samples import TrainSample


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]  # prompt tokens then response tokens (the last one the end token)
    prompt_len: int
    # Recorded behaviour log-probs for a prefix of the response tokens (all of them, or fewer when
    # the end token was not recorded or the response was truncated); the trainer fills the rest
    # from the policy at the start of the run. None: nothing usable was recorded.
    behaviour_logprobs: list[float] | None = None

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def n_response(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def response_mask(self) -> list[int]:
        return [0] * self.prompt_len + [1] * self.n_response


def ended_as_recorded(sample: TrainSample, tokenizer: Any) -> TrainSample:
    """``sample``, marked cut off (``complete`` false) when its recorded token ids end on an ordinary
    token: the model that answered did not end the answer, a length cap did (the responder keeps the end
    token it generated, shared/responder.py). An answer without recorded ids (another model's) stays as
    it is: nothing says how it ended."""
    ids = sample.behaviour_token_ids
    if not sample.complete or not ids:
        return sample
    ends = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ())}
    if tokenizer.eos_token_id is not None:
        ends.add(int(tokenizer.eos_token_id))
    return sample if int(ids[-1]) in ends else replace(sample, complete=False)


def encode_sample(tokenizer: Any, sample: TrainSample, max_tokens: int) -> Encoded:
    """Encode one sample: chat-templated prompt, then the response tokens and the end token.

    The end token is part of the response (and of its mask): it is what teaches answer length. An
    answer cut off at a length cap (``sample.complete`` false) gets none: the model did not end it.
    Stored behaviour log-probs are used only when the stored token ids are exactly the response's
    tokens (with or without the end token); a different tokenisation would pair log-probs with the
    wrong tokens. Over ``max_tokens`` the prompt loses tokens from its left (the turns nearest the
    answer matter most); a response too long by itself loses its tail, at least one prompt token is
    kept so the first response token has something to be predicted from.
    """
    if max_tokens < 2:
        raise ValueError("max_tokens must be at least 2")
    prompt = prompt_ids(tokenizer, sample.prompt)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end token")
    if not prompt:  # a template-less tokenizer and an empty prompt: the first token needs a context
        prompt = [int(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos)]
    body = token_ids(tokenizer(sample.response, add_special_tokens=False)["input_ids"])
    response = body + [int(eos)] if sample.complete else body

    behaviour: list[float] | None = None
    ids, lps = sample.behaviour_token_ids, sample.behaviour_logprobs
    if ids is not None and lps is not None and len(ids) == len(lps):
        if list(ids) == response or list(ids) == body:
            behaviour = [float(x) for x in lps]

    if len(response) > max_tokens - 1:
        response = response[: max_tokens - 1]
    prompt = prompt[-(max_tokens - len(response)) :]
    if behaviour is not None:
        behaviour = behaviour[: len(response)] or None
    return Encoded(input_ids=prompt + response, prompt_len=len(prompt), behaviour_logprobs=behaviour)


# Below this many tokens a shared prefix is not worth a pass of its own (:func:`shared_prefix`).
MIN_SHARED_PREFIX = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix(items: Sequence[Encoded]) -> int:
    """The tokens every one of ``items`` begins with that a trainer can encode once for all of them:
    their common prefix, up to the position before the earliest first response token (its hidden
    state predicts that token, so it must be computed per row); 0 below :data:`MIN_SHARED_PREFIX` or
    for a single item."""
    if len(items) < 2:
        return 0
    first = items[0].input_ids
    p = min(min(e.prompt_len for e in items) - 1, *(common_prefix(first, e.input_ids) for e in items[1:]))
    return p if p >= MIN_SHARED_PREFIX else 0


def fold_hosts(encoded: Sequence[Encoded]) -> list[int]:
    """Per item, the item whose pass computes its log-probs: itself, or a longer one (of equal length:
    an earlier one) that begins with all of its tokens but the last.

    A causal model predicts a row's tokens from the hidden states of the positions before them, and
    a row's last position predicts nothing: so such a row (an explored answer ended at an earlier
    sentence end is its answer's first tokens, then the end token) has its host's hidden states at
    every position it reads, and a trainer can read them there instead of running the row through
    the model. The host is the longest such item, and never folded itself."""
    keys = [tuple(e.input_ids) for e in encoded]
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    ordered = [keys[i] for i in order]
    rank = [(len(key), -i) for i, key in enumerate(keys)]
    hosts = list(range(len(keys)))
    for i, key in enumerate(keys):
        head = key[:-1]
        if not head:
            continue
        best = i
        # Everything that begins with ``head`` sorts in one run from the first key not below it.
        for j in islice(order, bisect_left(ordered, head), None):
            if keys[j][:len(head)] != head:
                break
            if rank[j] > rank[best]:
                best = j
        hosts[i] = best
    # A host's own host begins with all of the host's tokens but its last, so with all of the row's.
    for i in range(len(hosts)):
        while hosts[hosts[i]] != hosts[i]:
            hosts[i] = hosts[hosts[i]]
    return hosts


def micro_batches(
    encoded: Sequence[Encoded], max_tokens_per_batch: int, share_prefix: bool = False,
    hosts: Sequence[int] | None = None,
) -> list[list[int]]:
    """Indices grouped into micro-batches of similar length.

    Sorted by length, then packed while the tokens a pass computes stay within the budget: ``batch
    size * longest length`` (the padded token count), or with ``share_prefix`` (a backend that encodes a
    batch's :func:`shared_prefix` once) ``prefix + batch size * (longest - prefix)``. Similar lengths
    waste little on padding. A sample longer than the budget gets a batch of its own.

    With ``hosts`` (:func:`fold_hosts`) an item computed from another's pass goes into its host's
    micro-batch and costs it nothing: only hosts run, and only they are counted.
    """
    hosts = list(range(len(encoded))) if hosts is None else list(hosts)
    members: dict[int, list[int]] = {}
    for i, h in enumerate(hosts):
        if h != i:
            members.setdefault(h, []).append(i)
    order = sorted((i for i, h in enumerate(hosts) if h == i), key=lambda i: (encoded[i].length, i))
    batches: list[list[int]] = []
    current: list[int] = []  # the hosts of the batch being filled
    for i in order:
        longest = encoded[i].length  # sorted ascending: the newcomer is the longest
        p = shared_prefix([encoded[j] for j in (*current, i)]) if share_prefix and current else 0
        if current and p + (len(current) + 1) * (longest - p) > max_tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [[j for i in batch for j in (i, *members.get(i, ()))] for batch in batches]


def collate(items: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``response_mask`` (0 on padding), ``[B, L]``."""
    width = max(e.length for e in items)
    input_ids = torch.full((len(items), width), int(pad_id), dtype=torch.long)
    attention = torch.zeros((len(items), width), dtype=torch.long)
    response = torch.zeros((len(items), width), dtype=torch.bool)
    for row, e in enumerate(items):
        input_ids[row, : e.length] = torch.tensor(e.input_ids, dtype=torch.long)
        attention[row, : e.length] = 1
        response[row, e.prompt_len : e.length] = True
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}
