"""Rewrites as positives (``train.rewrite``): the hindsight teacher answers again under the user's words.

For each rated answer that came with words (:func:`.hindsight.hint_for`), the teacher
(:meth:`Backend.teacher`: the base reading the hint, or ``train.teacher``) samples a new answer to the
prompt with the hint in its context. Where the user's reward model (:mod:`.reward_features`, good
enough by the exploration's bar, ``train.reward_model_min_auc``) scores that answer above the rated
one, the run trains on it, after the original prompt without the hint, as a liked answer with the
explored answers' weight (``train.explore_weight``). A rewrite is not a rating: no ledger, EMA or
held-out set sees it, and the user's own ratings keep their advantages.

What the model would say if it had been told: on a taste it rarely shows, this is a liked answer the
run did not have to find by chance, and it is taught to the student without the hint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..presets import TrainConfig
from ..samples import TrainSample
from .backend import Backend
from .exploration import SAMPLE_ROWS, loops
from .hindsight import hint_for, with_hint
from .reward_features import RewardModelReport, features

# Seeds the teacher's draws apart from the exploration's (which start at train.seed).
_SEED_OFFSET = 7919


@dataclass(frozen=True)
class Rewrites:
    """The teacher's answers a run trains on as liked ones, the advantage of each, and its figures."""

    samples: list[TrainSample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    tried: int = 0  # answers the teacher wrote
    reason: str = ""
    seconds: float = 0.0

    def metrics(self) -> dict[str, float | int | str]:
        return {"rewritten": len(self.samples), "rewrites_tried": self.tried, "rewrite_reason": self.reason,
                "rewrite_seconds": self.seconds}


def why_not(samples: Sequence[TrainSample], report: RewardModelReport, cfg: TrainConfig) -> str | None:
    """Why this run writes no rewrites, or None when it does."""
    if not cfg.rewrite:
        return "off (train.rewrite = false)"
    if not any(hint_for(s) for s in samples):
        return "no rating with words to rewrite under"
    return report.unusable(cfg.reward_model_min_auc)


def rewrite(backend: Backend, samples: Sequence[TrainSample], report: RewardModelReport,
            cfg: TrainConfig) -> Rewrites:
    """The teacher's answers under each hint that the reward model scores above the rated answer; call
    inside the run's adapter session, before the first update (the reward model's features are the
    starting policy's)."""
    started = time.perf_counter()
    refused = why_not(samples, report, cfg)
    if refused is not None or report.model is None:
        return Rewrites(reason=refused or "no reward model", seconds=time.perf_counter() - started)
    rated = [(s, h) for s in samples if (h := hint_for(s)) is not None]
    prompts = [with_hint(s.prompt, h) for s, h in rated]
    cap = cfg.explore_max_new_tokens
    ids: list[list[int]] = []
    with backend.teacher(cfg.teacher):
        for start in range(0, len(prompts), SAMPLE_ROWS):
            ids += backend.sample(prompts[start:start + SAMPLE_ROWS], cap, cfg.seed + _SEED_OFFSET + start)
    tok = backend.tokenizer
    # Reward 0 as an explored answer's: not a rating; what it teaches is its advantage.
    written = [TrainSample(rating_id=None, prompt=s.prompt, response=tok.decode(a, skip_special_tokens=True),
                           reward=0.0, complete=len(a) < cap) for (s, _), a in zip(rated, ids, strict=True)]
    scores = report.model.score(features(backend, written + [s for s, _ in rated], cfg.max_tokens)).tolist()
    mine, theirs = scores[:len(written)], scores[len(written):]
    # A looping or empty rewrite is never a liked answer, whatever a model fitted on tens of ratings says.
    keep = [w for w, a, m, t, loop in zip(written, ids, mine, theirs, loops(ids), strict=True)
            if a and w.response.strip() and not loop and m > t]
    reason = (f"{len(keep)} of {len(written)} answers the teacher wrote under the user's words scored above the "
              f"rated answer (reward model AUC {report.auc:.3f})")
    return Rewrites(keep, [cfg.explore_weight] * len(keep), len(written), reason, time.perf_counter() - started)
