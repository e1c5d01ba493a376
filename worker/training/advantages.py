"""The advantage rule and the reward baseline: plain numbers, no tensor framework.

A rated answer's advantage is ``clip((r - ema) * (pos_weight if r > 0 else 1), -clip, clip)``; a
retraction (an undone or replaced rating that an earlier run trained on) brings a fixed advantage
instead. The arithmetic is float32, step by step, as the training tensors hold it: every backend
trains on the same advantages, bit for bit.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

EMA_SEED = 0.0


class Rated(Protocol):
    """What the rule reads from a sample (a :class:`rlfleet.worker.samples.TrainSample`)."""

    @property
    def reward(self) -> float: ...

    @property
    def fixed_advantage(self) -> float | None: ...


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


def run_advantages(samples: Sequence[Rated], ema: float | None, pos_weight: float, clip: float) -> list[float]:
    """Each sample's advantage in a run: a retraction keeps its fixed one, the rest get the rule
    against ``ema`` (without an EMA yet, against the neutral :data:`EMA_SEED`, as
    :func:`update_ema` seeds it)."""
    baseline = EMA_SEED if ema is None else ema
    return [
        advantage(s.reward, baseline, pos_weight, clip) if s.fixed_advantage is None else f32(float(s.fixed_advantage))
        for s in samples
    ]
