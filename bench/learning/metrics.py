"""What a checkpoint is scored by: pure functions over ratings, log-probs and token lists."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from rlfleet.worker.gate import distinct_n, repetition


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion (sane at 0 and n, unlike the normal approximation)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def preferred_rate(ratings: Sequence[int | None]) -> tuple[float, tuple[float, float], int]:
    """Share of rated answers the rater liked (None = no opinion, not counted), its CI, and n."""
    judged = [r for r in ratings if r is not None]
    liked = sum(1 for r in judged if r > 0)
    n = len(judged)
    return (liked / n if n else float("nan")), wilson(liked, n), n


def margin(good: Sequence[float], bad: Sequence[float]) -> float:
    """Mean log-prob of the good answers minus that of the bad ones."""
    if not good or not bad:
        return float("nan")
    return sum(good) / len(good) - sum(bad) / len(bad)


@dataclass(frozen=True)
class Checkpoint:
    ratings: int  # ratings given so far
    version: str | None  # adapter served
    rate: float  # preferred-behaviour rate on held-out prompts
    ci95: tuple[float, float]
    judged: int
    margin: float  # held-out good vs bad log-prob margin
    answer_words: float  # collapse signals
    distinct2: float
    repeat: float  # mean share of repeated trigrams within each answer, as the gate bounds it
    entropy_ratio: float
    seconds: float
    # The other named preferences' rates on the same answers: a control. A run that moves every one of
    # them alike (shorter, blander answers) learned a side effect, not the user's preference.
    controls: dict[str, float] = field(default_factory=dict)
    # A few held-out answers as text (the same prompts and seeds at every checkpoint): what a rate or a
    # collapse signal means, shown.
    examples: list[dict[str, str]] = field(default_factory=list)
    # With a second preference (--then): the first one's rate on the same answers, kept or forgotten.
    first_rate: float | None = None
    first_ci95: tuple[float, float] | None = None
    replayed: int = 0  # earlier ratings the runs since the previous checkpoint replayed

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        d["first_ci95"] = list(self.first_ci95) if self.first_ci95 is not None else None
        return d


def collapse_signals(token_lists: Sequence[Sequence[int]], texts: Sequence[str]) -> tuple[float, float]:
    """(mean answer length in words, distinct bigrams over all answers)."""
    n_words = [len(t.split()) for t in texts]
    return (sum(n_words) / len(n_words) if n_words else 0.0), distinct_n(token_lists, 2)


def repeat_share(token_lists: Sequence[Sequence[int]], end_id: int | None) -> float:
    """The gate's repeated-trigram share, on the answers cut before their end token the way the worker
    cuts the answers the gate samples."""
    return repetition([t[: list(t).index(end_id)] if end_id in t else t for t in token_lists])
