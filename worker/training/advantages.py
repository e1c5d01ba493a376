"""The advantage rules and the reward baseline: plain numbers, no tensor framework.

Two rules (``train.advantage``; docs/objective.md says when each helps):

- ``ema``: ``clip((r - ema) * (pos_weight if r > 0 else 1), -clip, clip)`` against the model's reward
  EMA, carried from run to run.
- ``asymmetric``: against the run's own mean reward minus ``delta``, a baseline just below the
  expected reward, with a 👎's advantage bounded in ``[-neg_bound, 0]``. A user who dislikes most
  answers then teaches mostly through the few they liked: pushing probability off many sampled
  answers at once is what raises the entropy (arXiv 2505.22617) and collapses the distribution when
  the baseline sits at or above the expected reward (AsymRE, arXiv 2506.20520).

With ``train.balance`` the rarer class is weighted up after either rule (:func:`balance_classes`),
so that the few liked answers of a taste the model rarely shows pull as hard, in total, as the many
disliked ones push: KTO's class weights (arXiv 2402.01306, Eq. 8), for the same reason.

An answer the run sampled itself to explore gets a group-relative advantage instead
(:func:`group_advantages`): its reward model score against the other answers to the same prompt.

A retraction (an undone or replaced rating that an earlier run trained on) brings a fixed advantage
under either rule. A sample with its own baseline (an environment's step, rlfleet.gym: its discounted
return against the batch's mean return at that step) gets :func:`return_advantage` under either rule.
The arithmetic is float32, step by step, as the training tensors hold it: every backend trains on the
same advantages, bit for bit.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Literal, Protocol

EMA_SEED = 0.0
Rule = Literal["ema", "asymmetric"]


class Rated(Protocol):
    """What the rule reads from a sample (a :class:`rlfleet.worker.samples.TrainSample`)."""

    @property
    def reward(self) -> float: ...

    @property
    def fixed_advantage(self) -> float | None: ...

    @property
    def baseline(self) -> float | None: ...


def update_ema(ema: float | None, rewards: Sequence[float], decay: float = 0.99) -> float:
    """The reward baseline after consuming ``rewards`` in order: ``ema = decay*ema + (1-decay)*r``.

    A missing EMA starts at the neutral 0.0, the midpoint of the ±1 rewards, rather than at the
    first rating or the first run's mean: either of those zeroes the advantage of the majority
    class in the first runs (measured: a first run of only good ratings learned nothing), while 0.0
    lets the first run push liked answers up and disliked ones down.
    """
    ema = EMA_SEED if ema is None else float(ema)
    for r in rewards:
        ema = decay * ema + (1.0 - decay) * float(r)
    return float(ema)


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32. Rounding each step of a float64 computation this way
    gives the float32 result exactly for +, -, * and /."""
    return struct.unpack("f", struct.pack("f", x))[0]


def advantage(reward: float, ema: float, pos_weight: float, clip: float = 2.0) -> float:
    """``A = clip((r - ema) * (pos_weight if r > 0 else 1), -clip, clip)`` in float32.

    ``pos_weight`` > 1 leans towards liked answers: with the EMA near the average rating a good
    answer would otherwise pull no harder than a bad one pushes.
    """
    r = f32(reward)
    adv = f32(r - f32(ema))
    if r > 0:
        adv = f32(adv * f32(pos_weight))
    bound = f32(clip)
    return min(max(adv, -bound), bound)


def asymmetric_advantage(reward: float, mean_reward: float, pos_weight: float, clip: float, delta: float,
                         neg_bound: float) -> float:
    """``A = r - (mean_reward - delta)`` in float32, liked answers times ``pos_weight``, a disliked
    answer's advantage kept in ``[-neg_bound, 0]`` (a 👎 never pushes its answer up), all within
    ``±clip``."""
    r = f32(reward)
    adv = f32(r - f32(f32(mean_reward) - f32(delta)))
    if r > 0:
        adv = f32(max(adv, 0.0) * f32(pos_weight))
    else:
        adv = min(max(adv, -f32(neg_bound)), 0.0)
    bound = f32(clip)
    return min(max(adv, -bound), bound)


def return_advantage(ret: float, baseline: float, pos_weight: float, clip: float = 2.0) -> float:
    """``A = clip((G - b) * (pos_weight if G > b else 1), -clip, clip)`` in float32: the ``ema`` rule with
    the sample's own baseline ``b``, its better-than-expected side weighted as a liked rating's is (for
    a rating, ``r > 0`` and ``r > ema`` are the same side)."""
    g, b = f32(ret), f32(baseline)
    adv = f32(g - b)
    if adv > 0:
        adv = f32(adv * f32(pos_weight))
    bound = f32(clip)
    return min(max(adv, -bound), bound)


def run_advantages(samples: Sequence[Rated], ema: float | None, pos_weight: float, clip: float, *,
                   rule: Rule = "ema", delta: float = 0.1, neg_bound: float = 0.5) -> list[float]:
    """Each sample's advantage in a run: a retraction keeps its fixed one, the rest get ``rule``
    (``ema`` without an EMA yet: against the neutral :data:`EMA_SEED`, as :func:`update_ema` seeds
    it; ``asymmetric``: against the mean reward of the run's rated samples); one with its own baseline
    gets :func:`return_advantage` against it, and stays out of the asymmetric rule's mean."""
    if rule == "asymmetric":
        rated = [float(s.reward) for s in samples if s.fixed_advantage is None and s.baseline is None]
        mean = f32(sum(rated) / len(rated)) if rated else 0.0

        def rated_advantage(r: float) -> float:
            return asymmetric_advantage(r, mean, pos_weight, clip, delta, neg_bound)
    else:
        baseline = EMA_SEED if ema is None else ema

        def rated_advantage(r: float) -> float:
            return advantage(r, baseline, pos_weight, clip)

    def one(s: Rated) -> float:
        if s.fixed_advantage is not None:
            return f32(float(s.fixed_advantage))
        if s.baseline is not None:
            return return_advantage(s.reward, s.baseline, pos_weight, clip)
        return rated_advantage(s.reward)

    return [one(s) for s in samples]


def balance_classes(advantages: Sequence[float], rated: Sequence[bool], cap: float) -> tuple[list[float], float]:
    """The rated samples' advantages with the rarer sign scaled up until both signs carry the same
    total, by at most ``cap``; the others (retractions) as they are. Returns them and the factor
    applied (1.0: nothing changed: ``cap`` <= 1, or one sign absent).

    Without it a user who likes 2 answers in 32 teaches mostly by pushing probability off the other
    30, which raises the entropy until a small model loops (arXiv 2505.22617); weighted, the liked
    answers pull it back onto the answers the user wants. No clip after the scaling: the objective's
    token and sequence bands stop a liked answer's push once its probability has risen by their
    bound, and the optimizer's gradient clip bounds the step."""
    pos = sum(a for a, r in zip(advantages, rated, strict=True) if r and a > 0)
    neg = -sum(a for a, r in zip(advantages, rated, strict=True) if r and a < 0)
    if cap <= 1.0 or pos <= 0.0 or neg <= 0.0:
        return list(advantages), 1.0
    factor = f32(min(cap, max(pos, neg) / min(pos, neg)))
    scale_positive = pos < neg
    return [f32(a * factor) if r and (a > 0 if scale_positive else a < 0) else a
            for a, r in zip(advantages, rated, strict=True)], factor


def group_advantages(scores: Sequence[float], weight: float, clip: float) -> list[float]:
    """The advantages of one prompt's sampled answers from their reward model scores (log-odds that
    the user likes each): ``clip(2 * weight * (p - mean p), -clip, clip)`` in float32, ``p`` the
    probability ``sigmoid(score)``, the mean over the group.

    Centred on the group, so how likely the user is to like any answer to this prompt teaches nothing.
    Not divided by the group's spread (Dr. GRPO, arXiv 2503.20783): with a taste the model rarely
    shows, most groups hold only answers the user would dislike, and z-scoring them turns the reward
    model's noise among them into full-size pushes, half of them down (measured: repetition rose and
    the gate refused the run). In probability units such a group gets next to nothing, and a group
    with one answer the user would like gives it up to ``2 * weight``, near a rating's advantage."""
    if not scores:
        return []
    probs = [1.0 / (1.0 + math.exp(-min(max(s, -60.0), 60.0))) for s in scores]
    mean = sum(probs) / len(probs)
    bound = f32(clip)
    return [min(max(f32(f32(2.0 * weight) * f32(p - mean)), -bound), bound) for p in probs]
