"""A rating's reward: its thumb, and its stars measured against what that person usually gives.

A thumb is ±1. Stars (``/rl 4``) refine it in a hybrid scheme: the reward is the thumb plus
:data:`STAR_WEIGHT` times how far the stars sit above or below the person's own usual stars, on a
scale where 1★ is -1, 3★ 0 and 5★ +1 (:func:`star_utility`). So a 👍 in 5 stars is worth more than a
bare 👍, a 👎 in 1 star less than a bare 👎, and a person who gives 5 to nearly everything says less
with a 5 than one who rarely does: each person's stars are centred on their own mean (shrunk toward 3★
by :data:`PRIOR_RATINGS` neutral ratings, so that one person's first star rating still counts). The
sign is always the thumb's: the stars move a reward by at most :data:`STAR_WEIGHT`, under 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STAR_WEIGHT = 0.5
PRIOR_RATINGS = 2


def star_utility(stars: int) -> float:
    """1★ -> -1, 3★ -> 0, 5★ -> +1."""
    return (stars - 3) / 2


def star_centre(given: Sequence[int]) -> float:
    """A person's usual stars on the utility scale: the mean of ``given`` with :data:`PRIOR_RATINGS`
    neutral ones added (0 for someone who never gave any)."""
    return sum(star_utility(s) for s in given) / (len(given) + PRIOR_RATINGS)


def star_centres(given: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """:func:`star_centre` per person."""
    return {who: star_centre(stars) for who, stars in given.items()}


def rating_reward(value: int, stars: int | None, centre: float = 0.0) -> float:
    """The thumb ``value`` (±1), plus :data:`STAR_WEIGHT` times the stars' utility above ``centre`` (the
    person's :func:`star_centre`), that difference kept within ±1; a bare thumb is its value."""
    if stars is None:
        return float(value)
    lift = min(max(star_utility(stars) - centre, -1.0), 1.0)
    return float(value) + STAR_WEIGHT * lift
