"""The environment's gate: a candidate version plays the same held-out episodes as its parent (the
same environment seeds, the same sampling seeds), and is promoted unless its mean return is worse
than the parent's beyond noise.

Paired episodes make the comparison tight: where both versions would act alike, their returns are
alike, and the difference's spread is what is left. ``judge_returns`` is the rule (pure);
``play_episode`` runs one episode of any Gymnasium-style environment (``reset(seed=)`` and a
five-tuple ``step``) without recording anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Z95 = 1.96


@dataclass(frozen=True)
class ReturnsVerdict:
    """How a candidate's held-out returns compare with its parent's on the same episodes."""

    ok: bool
    episodes: int
    parent_mean: float
    candidate_mean: float
    diff: float  # candidate minus parent, the mean of the paired differences
    half_width: float  # the 95 % interval's half width of ``diff``
    reason: str | None  # why it was refused

    def as_dict(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "parent_mean": self.parent_mean, "candidate_mean": self.candidate_mean,
                "diff": self.diff, "half_width": self.half_width, "ok": self.ok}


def mean_half_width(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """The mean and its normal-approximation interval's half width, ``z * sd / sqrt(n)`` (0 for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, z * sd / math.sqrt(n)


def judge_returns(parent: Sequence[float], candidate: Sequence[float], z: float = Z95) -> ReturnsVerdict:
    """Refuse the candidate only when its paired mean difference is below zero beyond the interval:
    ``diff + z * sd / sqrt(n) < 0``."""
    if len(parent) != len(candidate) or len(parent) < 2:
        raise ValueError(f"paired returns needed, at least two episodes each: got {len(parent)} and {len(candidate)}")
    n = len(parent)
    mean, half = mean_half_width([c - p for p, c in zip(parent, candidate, strict=True)], z)
    p_mean, c_mean = sum(parent) / n, sum(candidate) / n
    ok = mean + half >= 0.0
    reason = None if ok else (f"held-out mean return {c_mean:.3g} against the parent's {p_mean:.3g} on the same "
                              f"{n} episodes: {mean:+.3g} ± {half:.3g}, worse beyond noise")
    return ReturnsVerdict(ok, n, p_mean, c_mean, mean, half, reason)


def play_episode(env: Any, seed: int, act: Callable[[Any, int], Any], max_steps: int) -> float:
    """The total reward of one episode from ``env.reset(seed=seed)``, each action from
    ``act(observation, step)``; an action that cannot be made ends the episode with what it has."""
    observation, _info = env.reset(seed=seed)
    total = 0.0
    for t in range(max_steps):
        try:
            action = act(observation, t)
        except ActionFailed:
            break
        observation, reward, terminated, truncated, _info = env.step(action)
        total += float(reward)
        if terminated or truncated:
            break
    return total


class ActionFailed(Exception):
    """The agent's ``extract_action`` could not read an action from a held-out answer."""
