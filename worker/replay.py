"""Which earlier ratings a run replays: plain numbers, no store and no tensors.

A run trains on the ratings no earlier run consumed; without more, each served version drifts from
what the ones before it learned. So a run also mixes in a sample of earlier ratings: ratings a
promoted run of the current lineage trained on that are still active (never a retraction, never a
rating the gate holds out: those are still pending). ``train.replay`` sets how many, as a fraction
of the run's own fresh training ratings, capped by how many exist; the draw is seeded by the run id
(the same run replays the same ratings) and takes good and bad ratings half and half where both
exist, since a preference the model rarely shows leaves mostly bad ones.

A replayed rating that is later undone stops being replayed and is retracted once, with the
advantage of the run that consumed it; the later runs that replayed it are not taken back one by one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def wanted(n_new: int, fraction: float) -> int:
    """How many earlier ratings a run with ``n_new`` fresh training ratings replays, where that many
    exist (:func:`draw` takes what there is)."""
    if fraction <= 0 or n_new <= 0:
        return 0
    return math.floor(n_new * fraction + 0.5)


def draw(pool: Sequence[tuple[int, int]], n: int, run_id: int) -> list[int]:
    """``n`` rating ids from ``pool`` (``(rating id, value)`` pairs; all of them if it holds fewer), in
    id order: as many good as bad where both suffice (an odd one more good), the rest from whichever
    class has more. The same pool, ``n`` and run id always give the same ids, whatever order the pool
    comes in."""
    rng = random.Random(run_id)
    good = sorted(rid for rid, value in pool if value > 0)
    bad = sorted(rid for rid, value in pool if value <= 0)
    n = min(n, len(good) + len(bad))
    n_bad = min(len(bad), n // 2)
    n_good = min(len(good), n - n_bad)
    n_bad = n - n_good  # the good ones fell short: bad ones make up the rest
    return sorted(rng.sample(good, n_good) + rng.sample(bad, n_bad))
