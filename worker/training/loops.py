"""The policy's own loops, caught while it trains: the answers of the unlikelihood term.

A run on a taste the model rarely shows pushes mostly 👎s, and the probability it moves off their
tokens lands partly on copying the answer's own earlier words; on a small model the version then
loops ("a canvas of sapphire, and the earth is a canvas of sapphire"). Neither the rated answers nor
any anchor measured on them show it: the loops are in what the policy being trained generates. So,
with ``train.unlikelihood = w > 0``, every :data:`CHECK_EVERY` optimizer steps the run samples
:data:`ANSWERS` answers from the policy as it is at that step (the run's rated prompts, in turn),
marks each token that completes a trigram the answer already had (what the gate counts as repetition,
:func:`rlfleet.worker.gate.repeated_ngrams`), and from then on every step also lowers those tokens'
probability (sequence-level unlikelihood, arXiv 1908.04319: :func:`rlfleet.worker.objective.unlikelihood`).
An answer with no repeated trigram adds nothing and is not kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfleet.shared.chat_prompt import prompt_ids

from ..batching import Encoded
from ..samples import TrainSample
from .backend import Backend, Batch
from .exploration import distinct

# A micro-batch of caught answers, its rows' marks (row, first response position, marked positions)
# and its share of all the caught answers.
LoopBatch = tuple[Batch, list[tuple[int, int, list[int]]], float]

ANSWERS = 8  # answers sampled per check (one batched generate)
CHECK_EVERY = 2  # optimizer steps between checks; the first comes after this many updates
NEW_TOKENS = 48  # the length cap of a checked answer (the gate samples as many)
NGRAM = 3


def repeated_positions(tokens: Sequence[int], n: int = NGRAM) -> list[int]:
    """Indices ``t`` of the tokens that complete an n-gram already seen earlier in ``tokens``
    (ending before ``t``): the tokens that make an answer repeat itself."""
    seen: set[tuple[int, ...]] = set()
    marked = []
    for t in range(n - 1, len(tokens)):
        gram = tuple(tokens[t - n + 1 : t + 1])
        if gram in seen:
            marked.append(t)
        seen.add(gram)
    return marked


@dataclass
class LoopPool:
    """The looping answers a run has caught so far, each with its marked response positions."""

    encoded: list[Encoded] = field(default_factory=list)
    marks: list[list[int]] = field(default_factory=list)
    checked: int = 0  # answers sampled over all checks
    marked_tokens: int = 0
    sampled_tokens: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float | int]:
        return {
            "loop_checked": self.checked,
            "loop_answers": len(self.encoded),
            "loop_marked_share": self.marked_tokens / self.sampled_tokens if self.sampled_tokens else 0.0,
            "loop_seconds": self.seconds,
        }


def check(backend: Backend, pool: LoopPool, samples: Sequence[TrainSample], step: int, seed: int) -> None:
    """Sample :data:`ANSWERS` answers from the active policy for the run's prompts (the k-th check
    starts where the previous one stopped) and add those that repeat a trigram to ``pool``."""
    started = time.perf_counter()
    prompts = distinct([s.prompt for s in samples])
    if not prompts:
        return
    first = pool.checked % len(prompts)
    chosen = [prompts[(first + i) % len(prompts)] for i in range(ANSWERS)]
    # Row i is drawn from seed base + i: bases ANSWERS apart keep every check's rows on streams of their own.
    answers = backend.sample(chosen, NEW_TOKENS, (seed * 1_000 + step) * ANSWERS)
    for prompt, tokens in zip(chosen, answers, strict=True):
        marks = repeated_positions(tokens)
        pool.checked += 1
        pool.sampled_tokens += len(tokens)
        pool.marked_tokens += len(marks)
        if marks:
            ids = prompt_ids(backend.tokenizer, prompt)
            pool.encoded.append(Encoded(input_ids=ids + list(tokens), prompt_len=len(ids)))
            pool.marks.append(marks)
    pool.seconds += time.perf_counter() - started


def batched(backend: Backend, pool: LoopPool, budget: int) -> list[LoopBatch]:
    """The caught answers as micro-batches of at most ``budget`` padded tokens, for
    :meth:`Backend.accumulate_unlikelihood`."""
    groups, batches = backend.batches(pool.encoded, budget)
    n = len(pool.encoded)
    return [
        (batch, [(row, pool.encoded[i].prompt_len, pool.marks[i]) for row, i in enumerate(g)], len(g) / n)
        for g, batch in zip(groups, batches, strict=True)
    ]
