"""What a training run consumes and what it returns: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainSample:
    # None: an answer the run sampled itself to explore (training/exploration.py), not a rating: no
    # ledger, EMA or held-out set ever sees it.
    rating_id: int | None
    prompt: list[dict]  # chat messages [{"role": ..., "content": ...}]
    response: str
    reward: float  # +1 good, -1 bad; an environment's step: its discounted return (rlfleet.gym)
    behaviour_logprobs: list[float] | None = None  # per response token, recorded when our model answered
    behaviour_token_ids: list[int] | None = None  # the tokens those log-probs belong to
    # Set for a retraction: an already-trained rating that was undone or replaced. The run applies
    # the opposite of the update it once made, with this advantage, instead of r - ema.
    fixed_advantage: float | None = None
    # An earlier-trained rating mixed in again so the run does not forget it (worker/replay.py). It
    # trains like a fresh rating, but its recorded log-probs are ignored (an older version answered:
    # docs/objective.md) and the run does not consume it: it stays its original run's.
    replayed: bool = False
    # False: the answer was cut off at a length cap, not ended by the model; it trains without an end
    # token, which would otherwise teach the model to stop mid-sentence where the cap fell.
    complete: bool = True
    # The user's words with the rating (`/rl bad too long`, a one-click reason): the hint the hindsight
    # teacher reads (training/hindsight.py). None: a bare thumb.
    comment: str | None = None
    # The baseline this sample's reward is measured against, when it has its own: an environment's
    # step gets the batch's mean return at the same step (rlfleet.gym). None: the run's rule decides
    # (the EMA, or the run's mean reward: training/advantages.py).
    baseline: float | None = None
    # The version whose policy drew the answer (its adapter's name, BASE for the base model); None: not
    # known. A run that starts from that very version recomputes the behaviour log-probs itself rather
    # than trust the recorded ones (training/loop.py, docs/objective.md "Behaviour").
    answered_by: str | None = None


BASE = "base"  # TrainSample.answered_by of an answer the base model drew (no version is named so)


def drawn_by(adapter_version: str | None) -> str:
    """:attr:`TrainSample.answered_by` of an answer our model gave with ``adapter_version`` (a capture's
    or a gym step's; None: the base)."""
    return adapter_version or BASE


def started_from(parent_adapter: Path | None) -> str:
    """The version name a run starting from ``parent_adapter`` (a registry's version folder; None: a
    fresh adapter, the base) compares with :attr:`TrainSample.answered_by`."""
    return BASE if parent_adapter is None else Path(parent_adapter).name


@dataclass(frozen=True)
class Progress:
    step: int
    total: int
    tokens_per_s: float
    loss: float | None = None
    phase: str = "training"  # loading | exploring | reference | training | saving (| evaluating)


@dataclass
class RunResult:
    metrics: dict[str, float | int | str | None]  # None: a figure the run could not measure
    advantages: dict[int, float] = field(default_factory=dict)  # rating_id -> advantage used
    promoted_ok: bool = True  # the run's own sanity check (finite loss, KL under the limit)
    reason: str | None = None
