"""Hindsight distillation from the user's words (docs/objective.md, "Hindsight").

A rating that came with words (``/rl bad too long``, a one-click reason, ``/rl why``) says more than
its thumb: what the answer should have been. The teacher is a model that reads those words as a hint
(:func:`with_hint`, a fixed template) before the same answer: the base with the adapter off, or a
stronger model sharing the tokenizer (``train.teacher``). At every position of the rated answer it
gives a next-token distribution; the run pulls the student's toward it (``train.hindsight`` times
:func:`rlfleet.worker.objective.hindsight_kl`), beside the policy gradient on the thumb. This can move
probability onto tokens the student never sampled, which the thumb alone cannot (arXiv 2601.20802,
2603.10165).

The gap comes first: for each hinted answer the teacher's mean log-prob of it is compared with the
student's (the policy the run starts from), signed by the rating (a 👎's answer should become less
likely under the hint, a 👍's more). An answer is taught only where that gap clears
``train.hindsight_min_gap``: a hint the teacher cannot read (a small model barely follows one in
context) then teaches nothing rather than noise. The run reports the mean gap as ``teacher_gap``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..batching import Encoded, encode_sample
from ..presets import TrainConfig
from ..samples import TrainSample
from .backend import Backend, Batch

HINT_HEADER = "[What I want from your answer]"


def with_hint(prompt: list[dict], hint: str) -> list[dict]:
    """The prompt the teacher reads: ``hint`` appended to the last user turn under :data:`HINT_HEADER`
    (a user turn of its own where the prompt has none). The other turns, and the answer after them,
    are left exactly as they were: only the teacher's context changes."""
    note = f"{HINT_HEADER}\n{hint.strip()}"
    turns = [dict(t) for t in prompt]
    for t in reversed(turns):
        if t.get("role") == "user" and isinstance(t.get("content"), str):
            t["content"] = f"{t['content'].rstrip()}\n\n{note}"
            return turns
    return [*turns, {"role": "user", "content": note}]


def hint_for(sample: TrainSample) -> str | None:
    """The words a sample's teacher reads: a fresh rating's comment; None for a bare thumb, an
    explored answer and a retraction (undoing an update is not a lesson)."""
    if sample.rating_id is None or sample.fixed_advantage is not None:
        return None
    return (sample.comment or "").strip() or None


def signed_gap(teacher: Sequence[float], student: Sequence[float], reward: float) -> float:
    """How much the teacher moves an answer in its rating's direction: the teacher's mean per-token
    log-prob of it minus the student's, negated for a 👎 (whose answer the hint should make less
    likely)."""
    n = max(len(teacher), 1)
    diff = (sum(teacher) - sum(student)) / n
    return diff if reward > 0 else -diff


@dataclass(frozen=True)
class Lesson:
    """What the teacher gives a run: per student micro-batch its targets (None: nobody taught there)."""

    targets: list[Any]
    metrics: dict[str, float | int | None] = field(default_factory=dict)


def teach(
    backend: Backend, samples: Sequence[TrainSample], encoded: Sequence[Encoded], groups: Sequence[Sequence[int]],
    batches: Sequence[Batch], cfg: TrainConfig,
) -> Lesson:
    """Score every hinted sample under the teacher and the starting policy; targets for those whose gap
    clears the bar. Call inside the run's adapter session, before the first update."""
    none: list[Any] = [None] * len(batches)
    if cfg.hindsight <= 0:
        return Lesson(none)
    started = time.perf_counter()
    hints = {i: h for i, s in enumerate(samples) if (h := hint_for(s)) is not None}
    taught = hinted(backend, samples, encoded, hints, cfg.max_tokens)
    if not taught:
        return Lesson(none, {"hinted": len(hints), "hint_taught": 0, "teacher_gap": None})
    order = list(taught)
    with backend.teacher(cfg.teacher):
        teacher = rows_of(backend, [taught[i] for i in order], cfg.micro_batch_tokens,
                          lambda b: backend.response_top(b, cfg.hindsight_top_k))
    student = rows_of(backend, [encoded[i] for i in order], cfg.micro_batch_tokens, backend.response_logprobs)
    gaps = {i: signed_gap(teacher[j].token.tolist(), student[j], samples[i].reward) for j, i in enumerate(order)}
    rows = {i: (teacher[j], 1.0 / max(len(student[j]), 1)) for j, i in enumerate(order)
            if gaps[i] > cfg.hindsight_min_gap}
    targets = none
    if rows:
        targets = [backend.teacher_targets(b, [rows.get(i) for i in g]) if any(i in rows for i in g) else None
                   for g, b in zip(groups, batches, strict=True)]
    return Lesson(targets, {
        "hinted": len(hints),
        "hint_taught": len(rows),
        "teacher_gap": sum(gaps.values()) / len(gaps),
        "teacher_seconds": time.perf_counter() - started,
    })


def hinted(backend: Backend, samples: Sequence[TrainSample], encoded: Sequence[Encoded], hints: dict[int, str],
           max_tokens: int) -> dict[int, Encoded]:
    """Sample i (a key of ``hints``) as the teacher reads it: its prompt :func:`with_hint`, the same
    answer tokens as ``encoded[i]``; one whose answer the length cap cuts differently after the longer
    prompt is left out."""
    out: dict[int, Encoded] = {}
    for i, hint in hints.items():
        plain = replace(samples[i], prompt=with_hint(samples[i].prompt, hint), behaviour_logprobs=None,
                        behaviour_token_ids=None)
        e = encode_sample(backend.tokenizer, plain, max_tokens)
        if e.input_ids[e.prompt_len:] == encoded[i].input_ids[encoded[i].prompt_len:]:
            out[i] = e
    return out


def rows_of(backend: Backend, encoded: Sequence[Encoded], budget: int, score: Any) -> list[Any]:
    """``score`` of each encoded answer (a per-row list from one micro-batch of at most ``budget``
    tokens), in the given order."""
    groups, batches = backend.batches(encoded, budget)
    out: list[Any] = [None] * len(encoded)
    for g, rows in zip(groups, backend.each(score, batches), strict=True):
        for i, row in zip(g, rows, strict=True):
            out[i] = row
    return out

